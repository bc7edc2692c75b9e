"""torchrun's error file (launch/rootcause.py): where a rank's @record writes, and what a file
written by torch's own ErrorHandler reads back as: the traceback torchrun's summary shows, and
the time of the failure."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from snapshotter.agent.runtime import _read_regular
from snapshotter.launch import rootcause
from snapshotter.launch.env import RdzvAddress, placements, rank_env


def _fail_on_rank(rank: int) -> None:
    raise RuntimeError(f"injected bug at step 150 on rank {rank}")


def test_a_file_torch_wrote_reads_back_as_its_traceback_and_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    before = int(time.time())
    try:
        _fail_on_rank(1)
    except RuntimeError as e:
        ErrorHandler().record_exception(e)  # what @record does with an uncaught exception
    cause = rootcause.parse(path.read_bytes())
    assert cause is not None
    assert cause.error.startswith("Traceback (most recent call last)"), cause.error
    assert "in _fail_on_rank" in cause.error
    assert cause.error.endswith("RuntimeError: injected bug at step 150 on rank 1")
    assert before <= cause.time <= time.time()


def test_a_message_without_its_traceback_is_shown_before_what_stands_for_it() -> None:
    # record_exception called outside an except block: format_exc() has no traceback of it.
    doc = {"message": {"message": "ValueError: bad", "extraInfo": {
        "py_callstack": "NoneType: None\n", "timestamp": "1700000000"}}}  # fmt: skip
    assert rootcause.parse(json.dumps(doc)) == rootcause.RootCause(
        "ValueError: bad\nNoneType: None", 1700000000.0
    )


def test_the_plain_message_format_and_its_timestamp() -> None:
    # What a nanny's ErrorHandler.dump_error_file may pass on: message as a plain string.
    assert rootcause.parse(b'{"message": "Signal 9 (SIGKILL)", "timestamp": "12"}') == (
        rootcause.RootCause("Signal 9 (SIGKILL)", 12.0)
    )
    assert rootcause.parse(b'{"message": "no time"}') == rootcause.RootCause("no time", 0.0)


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"\xff\xfe", b"[]", b'{"other": 1}', b'{"message": 3}']
)
def test_anything_else_is_no_root_cause(data: bytes) -> None:
    assert rootcause.parse(data) is None


def test_a_time_that_is_no_number_is_no_time() -> None:
    doc = b'{"message": {"message": "x", "extraInfo": {"timestamp": "soon"}}}'
    assert rootcause.parse(doc) == rootcause.RootCause("x", 0.0)


def test_a_long_traceback_keeps_its_start_and_its_end_within_the_limit() -> None:
    text = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "RuntimeError: boom"
    clipped = rootcause.clip(text)
    assert len(clipped.encode()) <= rootcause.MAX_ERROR_BYTES
    assert clipped.startswith("Traceback (most recent call last):")
    assert clipped.endswith("RuntimeError: boom")
    assert "bytes cut" in clipped
    assert rootcause.clip("short") == "short"
    assert len(rootcause.clip("é" * 10_000).encode()) <= rootcause.MAX_ERROR_BYTES


def test_the_job_chooses_the_error_file_else_the_sandbox_directory_holds_it() -> None:
    assert rootcause.error_file({}, "/h/sandbox/j-r0") == "/h/sandbox/j-r0/" + rootcause.FILE_NAME
    mine = {"TORCHELASTIC_ERROR_FILE": "/data/err.json"}
    assert rootcause.error_file(mine, "/h/sandbox/j-r0") == "/data/err.json"
    p = placements(1, 1, 0)[0]
    env = rank_env(mine, p, RdzvAddress("h", 1), "j", None, rootcause.error_file(mine, "/x"))
    assert env["TORCHELASTIC_ERROR_FILE"] == "/data/err.json"


def test_the_agent_reads_regular_files_only(tmp_path: Path) -> None:
    assert _read_regular(str(tmp_path / "absent.json"), 100) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _read_regular(str(fifo), 100) is None  # and did not block on it
    f = tmp_path / "e.json"
    f.write_bytes(b"0123456789")
    assert _read_regular(str(f), 4) == b"0123"
