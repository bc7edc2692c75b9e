"""One owner per transfer (`TransferTasks`): it owns the tasks, their status, the first failure
and the cleanups to run if the transfer does not finish.

Modelled on s3transfer's TransferCoordinator: tasks are submitted through the owner,
which bounds how many are in flight (and so how much memory their buffers hold), records the
first exception any of them raises, refuses new work once one has failed, and runs the
registered cleanups (delete the chunks written so far) exactly once on abort. It knows nothing
about snapshots or stores.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class TransferStatus(enum.Enum):
    """Where a transfer stands.

        RUNNING --(a task fails)--> FAILED --abort()--> ABORTED
           |                                              ^
           +--------------------------abort()-------------+
           |
           +--done()--> DONE

    FAILED refuses new tasks; only RUNNING accepts them. DONE and ABORTED are final.
    """

    RUNNING = "running"
    FAILED = "failed"
    DONE = "done"
    ABORTED = "aborted"


class TransferTasks:
    """Runs tasks on a bounded thread pool; at most `max_in_flight` are submitted and not
    finished at any time (`submit` blocks the caller until one finishes)."""

    def __init__(self, workers: int, max_in_flight: int, name: str = "transfer") -> None:
        if workers < 1 or max_in_flight < workers:
            raise ValueError(f"need workers >= 1 and max_in_flight >= workers ({workers=})")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._status = TransferStatus.RUNNING
        self._exception: BaseException | None = None
        self._cleanups: list[Callable[[], Any]] = []

    @property
    def status(self) -> TransferStatus:
        return self._status

    @property
    def exception(self) -> BaseException | None:
        return self._exception

    def set_exception(self, exc: BaseException) -> None:
        """Record a failure; the first one wins and is what `wait` raises."""
        with self._lock:
            if self._exception is None:
                self._exception = exc
            if self._status is TransferStatus.RUNNING:
                self._status = TransferStatus.FAILED

    def raise_if_failed(self) -> None:
        if self._exception is not None:
            raise self._exception
        if self._status is not TransferStatus.RUNNING:
            raise RuntimeError(f"transfer is {self._status.value}; it accepts no more work")

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the pool, waiting for a free slot first.

        Raises the recorded failure instead if a task already failed, so the producer stops
        reading input as soon as anything goes wrong.
        """
        while not self._slots.acquire(timeout=0.5):
            self.raise_if_failed()
        try:
            self.raise_if_failed()
            with self._lock:
                self._in_flight += 1
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._on_done)
        return future

    def _on_done(self, future: Future[Any]) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            self.set_exception(exc)
        self._slots.release()
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def wait(self) -> None:
        """Wait until every submitted task has finished; raise the first failure if any."""
        with self._lock:
            while self._in_flight:
                self._idle.wait()
        if self._exception is not None:
            raise self._exception

    def add_cleanup(self, fn: Callable[[], Any]) -> None:
        """Register `fn` to run (in reverse registration order) if the transfer is aborted."""
        with self._lock:
            self._cleanups.append(fn)

    def done(self) -> None:
        """Mark success: cleanups are dropped, the pool is released."""
        self.wait()
        with self._lock:
            self._status = TransferStatus.DONE
            self._cleanups.clear()
        self._pool.shutdown(wait=True)

    def release_workers(self) -> None:
        """Stop the worker threads once every task finished, leaving the status and the
        cleanups as they are (someone else decides the transfer's fate; `abort` still runs
        the cleanups). No task may be submitted afterwards."""
        with self._lock:
            while self._in_flight:
                self._idle.wait()
        self._pool.shutdown(wait=True)

    def abort(self) -> list[BaseException]:
        """Stop: let running tasks finish, drop queued ones, run cleanups once.

        Returns the exceptions cleanups raised (they are logged, never raised, so one failing
        cleanup does not stop the others).
        """
        with self._lock:
            if self._status in (TransferStatus.DONE, TransferStatus.ABORTED):
                return []
            self._status = TransferStatus.ABORTED
            cleanups, self._cleanups = self._cleanups[::-1], []
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            while self._in_flight:
                self._idle.wait()
        errors: list[BaseException] = []
        for fn in cleanups:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - best effort by design
                log.warning("transfer cleanup %r failed: %s", fn, e)
                errors.append(e)
        return errors
