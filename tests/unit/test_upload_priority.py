"""The upload's CPU priority while a job trains on: per thread, inherited, and its setting."""

from __future__ import annotations

import os
import threading

import pytest

from snapshotter.config import upload_nice
from snapshotter.errors import InvalidArgument
from snapshotter.procutil import lower_this_thread


def test_a_lowered_thread_and_the_threads_it_starts_run_at_that_nice_the_caller_does_not() -> None:
    seen: dict[str, int] = {}

    def child() -> None:
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def upload() -> None:
        assert lower_this_thread(17)
        seen["upload"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=upload)
    t.start()
    t.join()
    assert seen == {"upload": 17, "child": 17}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_the_upload_nice_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOTTER_UPLOAD_NICE", raising=False)
    assert upload_nice() == 19
    monkeypatch.setenv("SNAPSHOTTER_UPLOAD_NICE", "0")
    assert upload_nice() == 0
    for bad in ("20", "-1", "low"):
        monkeypatch.setenv("SNAPSHOTTER_UPLOAD_NICE", bad)
        with pytest.raises(InvalidArgument) as e:
            upload_nice()
        assert "SNAPSHOTTER_UPLOAD_NICE" in e.value.cause and "0 to 19" in e.value.next_step
