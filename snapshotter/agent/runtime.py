"""The ranks of one job on this node: their sandboxes, control channels, logs and exit codes.

A `NodeJob` is created either by a launch (fresh sandboxes) or by a thaw (restored sandboxes);
from then on both are handled alike. Fail-fast like torchrun: when one rank fails, the others
are terminated. A job stopped by a freeze is FROZEN, not FAILED.
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from snapshotter.agent.logs import LogPump
from snapshotter.agent.rankctl import RankChannel
from snapshotter.agent.storeserver import StoreServer
from snapshotter.launch.env import RankPlacement, StoreAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.sandbox.spawn import Sandbox

log = logging.getLogger(__name__)


class NodeJobState(enum.Enum):
    """Lifecycle of a job's ranks on one node.

    RUNNING --all ranks exit 0--> SUCCEEDED
    RUNNING --a rank fails------> FAILED (the others are terminated)
    RUNNING --freeze --stop-----> FROZEN (ranks ended after the snapshot committed)
    RUNNING --cancel------------> CANCELLED
    """

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    FROZEN = "FROZEN"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self is not NodeJobState.RUNNING


@dataclass
class RankRuntime:
    """One rank as the agent holds it. Owns its sandbox (the init as a child, a pidfd), its
    control channel, its log pump and whatever `cleanups` the agent attached (the orphan
    record, the init's working directory); `close()` releases all of them once the sandbox
    has exited."""

    placement: RankPlacement
    sandbox: Sandbox
    channel: RankChannel
    pump: LogPump
    init_cwd: str
    exit_code: int | None = None
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.placement.rank

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.channel.close()
        self.pump.join(timeout=5)
        self.sandbox.close()
        for fn in self.cleanups:
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failed cleanup must not skip the others
                log.exception("cleanup of job rank %d failed", self.rank)


@dataclass
class NodeJob:
    spec: JobSpec
    node_rank: int
    # The job's rendezvous store: hosted by node 0's agent (`store` is set there only); every
    # node's ranks reach it at `store_address`.
    store: StoreServer | None
    remote_store: StoreAddress | None = None
    ranks: list[RankRuntime] = field(default_factory=list)
    state: NodeJobState = NodeJobState.RUNNING
    started: float = field(default_factory=time.time)
    ended: float | None = None
    # The freeze/thaw holding this job, so a freeze never overlaps another.
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stopping_reason: NodeJobState | None = None

    def watch(self) -> None:
        for r in self.ranks:
            threading.Thread(
                target=self._wait_rank,
                args=(r,),
                daemon=True,
                name=f"wait-{self.spec.job_id}-{r.rank}",
            ).start()

    def _wait_rank(self, r: RankRuntime) -> None:
        code = r.sandbox.wait()
        with self._cv:
            r.exit_code = code
            failed = code != 0 and self._stopping_reason is None
            if failed:
                self._stopping_reason = NodeJobState.FAILED
            self._cv.notify_all()
        if failed:
            log.warning(
                "job %s rank %d exited %s; stopping the others", self.spec.job_id, r.rank, code
            )
            self.terminate_all()
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._cv:
            if any(r.exit_code is None for r in self.ranks) or self.state.terminal:
                return
            if self._stopping_reason is not None:
                self.state = self._stopping_reason
            elif all(r.exit_code == 0 for r in self.ranks):
                self.state = NodeJobState.SUCCEEDED
            else:
                self.state = NodeJobState.FAILED
            self.ended = time.time()
            self._cv.notify_all()
        self.release()

    def release(self) -> None:
        """Release what the ranks and the store hold (every rank has exited)."""
        for r in self.ranks:
            r.close()
        if self.store is not None:
            self.store.stop()

    def _signal_alive(self, sig: int) -> None:
        for r in self.ranks:
            if r.exit_code is None:
                try:
                    r.sandbox.send_signal(sig)
                except ProcessLookupError:
                    pass

    def terminate_all(self, grace: float = 5.0) -> None:
        self._signal_alive(signal.SIGTERM)
        deadline = time.monotonic() + grace
        with self._cv:
            while any(r.exit_code is None for r in self.ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
        self._signal_alive(signal.SIGKILL)

    def stop(self, reason: NodeJobState) -> None:
        """End every rank on purpose (freeze --stop, cancel): not a failure."""
        with self._cv:
            if self._stopping_reason is None:
                self._stopping_reason = reason
        self._signal_alive(signal.SIGKILL)
        self.wait(timeout=30)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self.state.terminal:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)
        return True

    @property
    def store_address(self) -> StoreAddress:
        if self.store is not None:
            return self.store.address
        assert self.remote_store is not None, "a job has a store of its own or node 0's"
        return self.remote_store

    def alive_ranks(self) -> list[RankRuntime]:
        return [r for r in self.ranks if r.exit_code is None]

    def describe(self) -> dict[str, Any]:
        return {
            "job_id": self.spec.job_id,
            "node_rank": self.node_rank,
            "state": self.state.value,
            "store": {"host": self.store_address.host, "port": self.store_address.port},
            "started": self.started,
            "ended": self.ended,
            "ranks": [
                {
                    "rank": r.rank,
                    "local_rank": r.placement.local_rank,
                    "pid": r.sandbox.pid,
                    "exit_code": r.exit_code,
                }
                for r in self.ranks
            ],
        }
