"""TransferTasks: bounded in-flight tasks, first failure wins, cleanups once."""

from __future__ import annotations

import threading

import pytest

from snapshotter.storage.tasks import TransferStatus, TransferTasks

pytestmark = pytest.mark.timeout(10)


def test_runs_tasks_and_finishes() -> None:
    c = TransferTasks(workers=2, max_in_flight=4)
    futures = [c.submit(lambda x: x * 2, i) for i in range(20)]
    c.done()
    assert [f.result() for f in futures] == [i * 2 for i in range(20)]
    assert c.status is TransferStatus.DONE


def test_bounds_tasks_in_flight() -> None:
    c = TransferTasks(workers=2, max_in_flight=3)
    release = threading.Event()
    lock = threading.Lock()
    live = [0, 0]  # current, max

    def task() -> None:
        with lock:
            live[0] += 1
            live[1] = max(live[1], live[0])
        release.wait(5)
        with lock:
            live[0] -= 1

    submitted = []

    def producer() -> None:
        for _ in range(10):
            submitted.append(c.submit(task))

    t = threading.Thread(target=producer)
    t.start()
    t.join(0.3)
    assert t.is_alive(), "submit should block once 3 tasks are in flight"
    assert len(submitted) == 3
    release.set()
    t.join(5)
    c.done()
    assert live[1] <= 2  # never more running than workers


def test_first_exception_wins_and_stops_submissions() -> None:
    c = TransferTasks(workers=1, max_in_flight=1)

    def boom(msg: str) -> None:
        raise OSError(msg)

    c.submit(boom, "first")
    with pytest.raises(OSError, match="first"):
        c.wait()
    assert c.status is TransferStatus.FAILED
    with pytest.raises(OSError, match="first"):
        c.submit(boom, "second")
    c.set_exception(ValueError("later"))
    assert str(c.exception) == "first"
    c.abort()


def test_abort_runs_cleanups_once_in_reverse_and_survives_failing_ones() -> None:
    c = TransferTasks(workers=1, max_in_flight=1)
    ran: list[str] = []
    c.add_cleanup(lambda: ran.append("chunks"))

    def broken() -> None:
        raise RuntimeError("cleanup failed")

    c.add_cleanup(broken)
    c.add_cleanup(lambda: ran.append("manifest"))
    errors = c.abort()
    assert ran == ["manifest", "chunks"]
    assert [str(e) for e in errors] == ["cleanup failed"]
    assert c.abort() == []
    assert ran == ["manifest", "chunks"]
    assert c.status is TransferStatus.ABORTED
    with pytest.raises(RuntimeError, match="aborted"):
        c.submit(lambda: None)


def test_done_drops_cleanups() -> None:
    c = TransferTasks(workers=1, max_in_flight=1)
    ran: list[str] = []
    c.add_cleanup(lambda: ran.append("x"))
    c.done()
    assert c.abort() == []
    assert ran == []
