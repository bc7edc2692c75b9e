"""The services' log setup (snapshotter/servicelog.py): JSON records and the level filter."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from snapshotter import servicelog


@pytest.fixture()
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield io.StringIO()
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_records_at_the_chosen_level(
    captured: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPSHOTTER_LOG_FORMAT", "json")
    monkeypatch.setenv("SNAPSHOTTER_LOG_LEVEL", "warning")
    servicelog.setup(captured)
    log = logging.getLogger("snapshotter.test")
    log.info("not shown")
    log.warning("node %s lost", "b")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("freeze failed")
    records = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert [(r["level"], r["message"]) for r in records] == [
        ("warning", "node b lost"), ("error", "freeze failed")]
    assert records[0]["logger"] == "snapshotter.test" and records[0]["time"].endswith("Z")
    assert "ValueError: boom" in records[1]["exception"]


def test_text_by_default(captured: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOTTER_LOG_FORMAT", raising=False)
    monkeypatch.delenv("SNAPSHOTTER_LOG_LEVEL", raising=False)
    servicelog.setup(captured)
    logging.getLogger("snapshotter.test").debug("hidden")
    logging.getLogger("snapshotter.test").info("shown")
    (line,) = captured.getvalue().splitlines()
    assert line.endswith(" INFO snapshotter.test: shown")
