"""Shared fixtures. End-to-end tests need root and CRIU; they are skipped with a reason
otherwise (CI runs as root after deploy/install.sh, so there they run)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import SnapCli


def _criu_ready() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        from snapshotter.sandbox.criu import criu_binary

        criu_binary()
    except Exception as e:  # noqa: BLE001 - any reason is a skip reason
        return f"CRIU unavailable: {e}"
    return None


@pytest.fixture()
def snap(tmp_path: Path) -> Iterator[SnapCli]:
    reason = _criu_ready()
    if reason:
        pytest.skip(reason)
    cli = SnapCli(tmp_path / "home")
    try:
        yield cli
    finally:
        cli.close()
