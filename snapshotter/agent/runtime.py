"""The ranks of one job on this node, and the agent's table of jobs.

A `NodeJob` is created either by a launch (fresh sandboxes) or by a thaw (restored sandboxes);
from then on both are handled alike. Fail-fast like torchrun: when one rank fails, the others
are terminated. A job stopped by a freeze is FROZEN, not FAILED. Every step the agent takes on
a job's ranks fans out through `NodeJob.each` (one thread per rank, up to a bound).
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from snapshotter import errors, parallel
from snapshotter.agent import retention
from snapshotter.agent.logs import KeptPump, LogPump
from snapshotter.agent.rankctl import RankChannel
from snapshotter.agent.rdzv import RdzvServer
from snapshotter.launch import rootcause
from snapshotter.launch.env import RankPlacement, RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.sandbox.spawn import Sandbox
from snapshotter.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)
R = TypeVar("R")


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
    has exited. A rank that failed keeps the root cause its `@record` wrote to `error_file`
    (launch/rootcause.py) in `error` and `error_time`."""

    placement: RankPlacement
    sandbox: Sandbox
    channel: RankChannel
    pump: LogPump | KeptPump
    init_cwd: str
    error_file: str = ""
    exit_code: int | None = None
    error: str = ""
    error_time: float = 0.0
    cleanups: list[Callable[[], None]] = field(default_factory=list)
    _closed: bool = False

    @property
    def rank(self) -> int:
        return self.placement.rank

    def read_error(self) -> None:
        """Keep the root cause in the rank's error file, if it wrote one (read before the
        sandbox's directory, where it lies, goes with `close()`)."""
        if not self.error_file:
            return
        try:
            data = _read_regular(self.error_file, rootcause.MAX_FILE_BYTES)
        except OSError as e:
            log.warning("rank %d: cannot read its error file %s: %s", self.rank,
                        self.error_file, e)  # fmt: skip
            return
        if data is None:
            return
        cause = rootcause.parse(data)
        if cause is None:
            log.warning("rank %d: its error file %s is not torch's format", self.rank,
                        self.error_file)  # fmt: skip
            return
        self.error, self.error_time = cause.error, cause.time

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
    # The job's rendezvous server: hosted by node 0's agent (`rdzv` is set there only); every
    # node's ranks reach it at `rdzv_address`.
    rdzv: RdzvServer | None
    remote_rdzv: RdzvAddress | None = None
    ranks: list[RankRuntime] = field(default_factory=list)
    state: NodeJobState = NodeJobState.RUNNING
    started: float = field(default_factory=time.time)
    ended: float | None = None
    # The freeze/thaw holding this job, so a freeze never overlaps another.
    op_lock: threading.Lock = field(default_factory=threading.Lock)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stopping_reason: NodeJobState | None = None
    # The rank whose failure ended the others (what recovery reports as the cause).
    failed_first: int | None = None
    # The data-link plane its communicators use (agent/links.py).
    plane: int = 0

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
        if code != 0:
            r.read_error()  # before its exit shows: a status that shows the exit shows why
        with self._cv:
            r.exit_code = code
            if r not in self.ranks:  # let go: it runs on another node now
                self._cv.notify_all()
                gone = True
            else:
                gone = False
        if gone:
            r.close()
            return
        with self._cv:
            failed = code != 0 and self._stopping_reason is None
            if failed:
                self._stopping_reason = NodeJobState.FAILED
                self.failed_first = r.rank
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

    def let_go(self, ranks: set[int], timeout: float = 30.0) -> None:
        """End these ranks, which a migration restored on another node: they leave this
        node's job, which goes on with the others; their exit is no failure."""
        with self._cv:
            going = [r for r in self.ranks if r.rank in ranks]
            self.ranks = [r for r in self.ranks if r.rank not in ranks]
        for r in going:
            if r.exit_code is None:
                try:
                    r.sandbox.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        with self._cv:
            while any(r.exit_code is None for r in going) and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        """Release what the ranks and the store hold (every rank has exited)."""
        for r in self.ranks:
            r.close()
        if self.rdzv is not None:
            self.rdzv.stop()

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
    def rdzv_address(self) -> RdzvAddress:
        if self.rdzv is not None:
            return self.rdzv.address
        assert self.remote_rdzv is not None, "a job has a rendezvous server or node 0's"
        return self.remote_rdzv

    def alive_ranks(self) -> list[RankRuntime]:
        return [r for r in self.ranks if r.exit_code is None]

    def each(
        self, fn: Callable[[RankRuntime], R], workers: int, only: set[int] | None = None
    ) -> dict[int, R]:
        """`fn` on every rank (`only` those) at once; results by rank, or the first failure
        raised.

        Raises:
            FreezeFailed: a rank has already exited (a job with dead ranks cannot be frozen).
        """
        ranks = self.alive_ranks()
        if len(ranks) != len(self.ranks):
            gone = [r.rank for r in self.ranks if r.exit_code is not None]
            raise errors.FreezeFailed(
                f"rank(s) {gone} of job {self.spec.job_id} have exited",
                "see `snapshotter logs`; a job with dead ranks cannot be frozen",
            )
        if only is not None:
            ranks = [r for r in ranks if r.rank in only]
        out = parallel.each(ranks, fn, key=lambda r: r.rank, workers=workers, name="rank")
        out.raise_first()
        return out.results

    def to_proto(self, with_spec: bool = False) -> agent_pb2.NodeJob:
        addr = self.rdzv_address
        m = agent_pb2.NodeJob(
            job_id=self.spec.job_id,
            node_rank=self.node_rank,
            state=self.state.value,
            rdzv=common_pb2.Endpoint(host=addr.host, port=addr.port),
            started=self.started,
            ranks=[
                common_pb2.RankState(
                    rank=r.rank,
                    local_rank=r.placement.local_rank,
                    pid=r.sandbox.pid,
                    exit_code=r.exit_code,
                    failed_first=r.rank == self.failed_first,
                    error=r.error,
                    error_time=r.error_time,
                )  # fmt: skip
                for r in self.ranks
            ],
        )
        if self.ended is not None:
            m.ended = self.ended
        if with_spec:
            m.spec.CopyFrom(self.spec.to_proto())
        return m


class JobTable:
    """The jobs this agent holds, and the launches in progress (which a Cancel may stop)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._jobs: dict[str, NodeJob] = {}
        self._launching: dict[str, threading.Event] = {}

    def get(self, job_id: str) -> NodeJob:
        with self._lock:
            j = self._jobs.get(job_id)
        if j is None:
            raise errors.JobNotFound(job_id)
        return j

    def running(self, job_id: str) -> NodeJob:
        j = self.get(job_id)
        if j.state is not NodeJobState.RUNNING:
            raise errors.JobNotRunning(
                f"job {job_id} is {j.state.value}, not running",
                "only a running job can be frozen; `snapshotter list` shows its snapshots",
            )
        return j

    def _live(self, job_id: str) -> bool:
        old = self._jobs.get(job_id)
        return (old is not None and not old.state.terminal) or job_id in self._launching

    def begin_launch(self, job_id: str) -> threading.Event:
        """Reserve `job_id` for a launch or restore; the event is set by a Cancel meanwhile.

        Raises: InvalidArgument if the job already runs here.
        """
        with self._lock:
            if self._live(job_id):
                raise errors.InvalidArgument(
                    f"job {job_id} is already running on node {self.node}",
                    "choose another --job-id",
                )
            cancelled = threading.Event()
            self._launching[job_id] = cancelled
            return cancelled

    def end_launch(self, job_id: str, job: NodeJob | None) -> None:
        """The launch is over: `job` (None: it failed) now holds the id."""
        with self._lock:
            self._launching.pop(job_id, None)
            if job is not None:
                self._jobs[job_id] = job

    def cancel_launch(self, job_id: str) -> bool:
        with self._lock:
            ev = self._launching.get(job_id)
        if ev is not None:
            ev.set()
        return ev is not None

    def all(self) -> list[NodeJob]:
        with self._lock:
            return list(self._jobs.values())

    def running_ids(self) -> list[str]:
        return [j.spec.job_id for j in self.all() if not j.state.terminal]

    def launching_ids(self) -> list[str]:
        """Jobs being launched or restored here (between `begin_launch` and `end_launch`)."""
        with self._lock:
            return list(self._launching)

    def forget_finished(self, keep: int, max_age_s: float) -> list[str]:
        """Forget old finished jobs (agent/retention.py); return their ids."""
        wall = time.time()
        with self._lock:
            finished = {j: job.ended or wall for j, job in self._jobs.items() if job.state.terminal}
            gone = retention.jobs_to_forget(finished, wall, keep, max_age_s)
            for j in gone:
                del self._jobs[j]
            return [j for j in gone if not self._live(j)]


def _read_regular(path: str, limit: int) -> bytes | None:
    """At most `limit` bytes of the regular file `path`; None if there is none (a path the
    job chose may name anything: a FIFO must not block the rank's watcher).

    Raises: OSError other than the file not existing.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit)
