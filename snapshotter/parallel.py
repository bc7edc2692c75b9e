"""Run one call on every item at once, and collect what each returned or raised.

Fan-outs on threads go through `each`: an agent's step on every rank, restores of a node's
ranks, the GPU stage on every CUDA process, the coordinator's calls that differ per agent. (The
coordinator's uniform calls on every agent of a job go out on its event loop instead:
coordinator/agents.py `call_all`.) A failure of one item never stops the others; the caller
decides what the failures mean.

Without a bound on workers every item's call starts at once (a freeze's Park and Resume block
until every node's ranks got theirs: a bounded pool would deadlock them). Those threads come
from one cached pool that keeps idle ones for a while: a coordinator driving 2,048 agents
would otherwise start (and reap) 2,048 threads for every phase (0.15 s of CPU each time).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


@dataclass
class Outcome(Generic[K, R]):
    """Results and failures by key, both in the order the items were given."""

    results: dict[K, R] = field(default_factory=dict)
    failures: dict[K, BaseException] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_first(self) -> None:
        """Raise the failure of the first item that failed, if any."""
        for e in self.failures.values():
            raise e


def each(
    items: Iterable[T],
    fn: Callable[[T], R],
    key: Callable[[T], K],
    *,
    workers: int | None = None,
    timeout: float | None = None,
    overdue: Callable[[T, float], BaseException] | None = None,
    first_failure: Callable[[T, BaseException], None] | None = None,
    name: str = "each",
) -> Outcome[K, R]:
    """`fn(item)` for every item on up to `workers` threads (default: one per item, from the
    shared cached pool).

    With `timeout`, a call still running then counts as failed (`overdue(item, timeout)`, or a
    TimeoutError) and is left to finish in the background; without, every call is waited for.
    `first_failure(item, error)` runs once, as soon as the first call fails, while the others
    may still run: the caller can cut short what would only wait for the failed one.
    """
    todo = list(items)
    out: Outcome[K, R] = Outcome()
    if not todo:
        return out
    pool: Executor = (
        ThreadPoolExecutor(max_workers=max(1, min(len(todo), workers)), thread_name_prefix=name)
        if workers
        else CACHED
    )
    try:
        futs: list[tuple[T, Future[R]]] = [(it, pool.submit(fn, it)) for it in todo]
        if first_failure is not None:
            _on_first_failure(futs, first_failure, timeout)
        done, _ = wait([f for _, f in futs], timeout=timeout)
        for it, f in futs:
            k = key(it)
            if f not in done:
                assert timeout is not None
                out.failures[k] = (
                    overdue(it, timeout)
                    if overdue is not None
                    else TimeoutError(f"{name}: no answer within {timeout:.0f}s")
                )
                continue
            e = f.exception()
            if e is not None:
                out.failures[k] = e
            else:
                out.results[k] = f.result()
        return out
    finally:
        if pool is not CACHED:
            pool.shutdown(wait=timeout is None, cancel_futures=timeout is not None)


def _on_first_failure(
    futs: list[tuple[T, Future[R]]], hook: Callable[[T, BaseException], None], timeout: float | None
) -> None:
    """Wait until every call ended or one failed (or `timeout`); on a failure, run `hook`."""
    done, _ = wait([f for _, f in futs], timeout=timeout, return_when=FIRST_EXCEPTION)
    for it, f in futs:
        e = f.exception() if f in done else None
        if e is not None:
            hook(it, e)
            return


class CachedThreads(Executor):
    """Runs every call submitted at once, on an idle thread when one is waiting, else on a
    new one (never queued behind others: no bound, so no deadlock between calls that wait
    for each other). A thread idle for `idle_s` ends: long enough to serve a freeze's
    back-to-back phases, short enough that 2,048 idle threads (~80 MiB) do not stay."""

    def __init__(self, idle_s: float = 10.0, prefix: str = "parallel") -> None:
        self.idle_s = idle_s
        self._prefix = prefix
        self._idle: list[queue.SimpleQueue[Any]] = []  # each idle thread's inbox, newest last
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future[R]:
        fut: Future[R] = Future()
        task = (fut, fn, args, kwargs)
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put(task)
            return fut
        inbox = queue.SimpleQueue()
        inbox.put(task)
        threading.Thread(target=self._work, args=(inbox,), daemon=True,
                         name=f"{self._prefix}-{next(self._ids)}").start()  # fmt: skip
        return fut

    def _work(self, inbox: queue.SimpleQueue[Any]) -> None:
        while True:
            try:
                fut, fn, args, kwargs = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                continue  # taken off the idle list just now: its task is on the way
            result: Any = None
            error: BaseException | None = None
            running = fut.set_running_or_notify_cancel()
            if running:
                try:
                    result = fn(*args, **kwargs)
                except BaseException as e:  # noqa: BLE001 - the caller's to judge
                    error = e
            # Idle before the caller hears of it: a caller that submits its next round at
            # once finds this thread waiting, instead of starting another.
            with self._lock:
                self._idle.append(inbox)
            if running:
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)
            del fut, fn, args, kwargs, result, error  # nothing of the task outlives it

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)


CACHED = CachedThreads()
