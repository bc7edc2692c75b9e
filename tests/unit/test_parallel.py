"""parallel.each: every call's result or failure, and the hook that cuts short what would only
wait for a call that already failed (a thaw cancels the other nodes' restores with it)."""

from __future__ import annotations

import threading
import time

import pytest

from snapshotter import parallel


def test_results_and_failures_by_key_in_order() -> None:
    def fn(x: int) -> int:
        if x % 2:
            raise ValueError(f"odd {x}")
        return x * 10

    out = parallel.each([1, 2, 3, 4], fn, key=lambda x: x)
    assert out.results == {2: 20, 4: 40}
    assert list(out.failures) == [1, 3] and not out.ok
    with pytest.raises(ValueError, match="odd 1"):
        out.raise_first()


def test_first_failure_runs_once_while_the_others_still_wait() -> None:
    released = threading.Event()
    seen: list[tuple[str, str]] = []

    def fn(name: str) -> str:
        if name.startswith("bad"):
            time.sleep(0.05 if name == "bad1" else 0.2)
            raise RuntimeError(name)
        # Waits for the hook: without it, this call would never end.
        assert released.wait(10), "first_failure did not run while this call waited"
        return name

    def hook(item: str, e: BaseException) -> None:
        seen.append((item, str(e)))
        released.set()

    out = parallel.each(["ok", "bad1", "bad2"], fn, key=lambda x: x, first_failure=hook)
    assert seen == [("bad1", "bad1")]  # once, for the first one to fail
    assert out.results == {"ok": "ok"} and set(out.failures) == {"bad1", "bad2"}


def test_first_failure_is_not_called_when_all_succeed() -> None:
    calls: list[str] = []
    out = parallel.each(["a", "b"], str.upper, key=lambda x: x,
                        first_failure=lambda it, e: calls.append(it))  # fmt: skip
    assert out.results == {"a": "A", "b": "B"} and calls == []


def test_every_item_runs_at_once_on_threads_reused_across_rounds() -> None:
    # Calls that wait for each other (a freeze's Park and Resume) must all be in flight at
    # once: 64 calls meet at a 64-party barrier, which a bounded pool would never let them.
    pool = parallel.CachedThreads(idle_s=5.0)
    for _ in range(3):
        barrier = threading.Barrier(64, timeout=10)
        futs = [pool.submit(barrier.wait) for _ in range(64)]
        assert sorted(f.result(timeout=10) for f in futs) == list(range(64))
    # The second and third rounds found the first round's threads idle, not new ones.
    assert pool.idle() == 64
    assert sum(t.name.startswith("parallel-") for t in threading.enumerate()) >= 64


def test_a_cached_thread_hands_back_failures_and_ends_when_idle() -> None:
    pool = parallel.CachedThreads(idle_s=0.1)
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(timeout=5)
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    deadline = time.monotonic() + 5
    while pool.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.idle() == 0
