"""A failed job's summary is laid out as torchrun's: other failures, then the root cause with
the traceback its @record wrote (or the signal that ended it)."""

from __future__ import annotations

from snapshotter.cli.failures import summary

TB = "Traceback (most recent call last):\n  File \"t.py\", line 6\nRuntimeError: bug"


def _st(ranks: list[dict], state: str = "FAILED") -> dict:
    return {"state": state, "script": "train.py", "ranks": ranks}


def test_the_root_cause_is_the_rank_that_failed_first_with_its_traceback() -> None:
    text = summary(_st([
        {"rank": 0, "local_rank": 0, "pid": 10, "exit_code": 143},
        {"rank": 1, "local_rank": 1, "pid": 11, "exit_code": 1, "failed_first": True,
         "error": TB, "error_time": 1_800_000_000.0},
    ]))  # fmt: skip
    head, root = text.split("Root Cause (first observed failure):")
    assert head.startswith("=" * 60 + "\ntrain.py FAILED\n")
    assert "[0]:" in head and "Signal 15 (SIGTERM) received by PID 10" in head
    assert "[1]:" in root and "exitcode  : 1 (pid: 11)" in root
    assert "  traceback : Traceback (most recent call last):" in root
    assert "\n  RuntimeError: bug\n" in root and root.endswith("=" * 60)


def test_without_a_recorded_error_the_earliest_failure_is_the_root_cause() -> None:
    text = summary(_st([{"rank": 3, "pid": 9, "exit_code": -9}]))
    assert "<NO_OTHER_FAILURES>" in text and "Signal 9 (SIGKILL) received by PID 9" in text


def test_nothing_for_a_job_that_did_not_fail() -> None:
    assert summary(_st([{"rank": 0, "exit_code": 0}], "SUCCEEDED")) == ""
    assert summary(_st([{"rank": 0, "exit_code": None}], "FAILED")) == ""
