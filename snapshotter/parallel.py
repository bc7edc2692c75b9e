"""Run one call on every item at once, and collect what each returned or raised.

Every fan-out goes through `each`: the coordinator's call to every agent of a job, an agent's
step on every rank, restores of a node's ranks, the GPU stage on every CUDA process. A failure
of one item never stops the others; the caller decides what the failures mean.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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
    """`fn(item)` for every item on up to `workers` threads (default: one per item).

    With `timeout`, a call still running then counts as failed (`overdue(item, timeout)`, or a
    TimeoutError) and is left to finish in the background; without, every call is waited for.
    `first_failure(item, error)` runs once, as soon as the first call fails, while the others
    may still run: the caller can cut short what would only wait for the failed one.
    """
    todo = list(items)
    out: Outcome[K, R] = Outcome()
    if not todo:
        return out
    pool = ThreadPoolExecutor(
        max_workers=max(1, min(len(todo), workers or len(todo))), thread_name_prefix=name
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
