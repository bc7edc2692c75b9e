"""The freeze phases on one node, and the lease that ends a freeze its coordinator abandoned.

The coordinator drives a freeze across every agent of a job (snapshotter/coordinator/
freeze.py); each phase here acts on all of this node's ranks at once and only reports: the
coordinator decides whether the freeze goes on. No phase may leave a rank parked or
suspended when it fails: the coordinator's Abort or Resume puts the ranks back, and if the
coordinator goes silent (or a newer one appears), the lease does it here.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from snapshotter import errors
from snapshotter.agent import handoff
from snapshotter.agent.local_copy import LocalCopies
from snapshotter.agent.progress import HOLD_S as PROGRESS_HOLD_S
from snapshotter.agent.progress import rank_state
from snapshotter.agent.rankctl import progress_all
from snapshotter.agent.runtime import JobTable, NodeJob, NodeJobState, RankRuntime
from snapshotter.agent.unparked import WHERE_WAIT_S, unparked
from snapshotter.config import Paths, upload_nice
from snapshotter.gpu.stage import GpuHold, GpuStage
from snapshotter.hook import protocol
from snapshotter.launch.env import RdzvAddress, resume_env
from snapshotter.procutil import STOPPED_STATES, lower_this_thread
from snapshotter.rpc import convert
from snapshotter.sandbox import criu, files
from snapshotter.sandbox.spawn import PRIVATE_TMP
from snapshotter.storage import dirstream
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.format import StreamInfo
from snapshotter.storage.sealing import Seal
from snapshotter.storage.transfer import Progress, SnapshotWriter
from snapshotter.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)


class FreezePhase(enum.Enum):
    """Where one freeze stands on this node.

    ::

        PREPARED --park--> PARKED --suspend--> SUSPENDED --dump--> DUMPED --resume--> RESUMED
           |                 |                     |                 |                   |
           '-----abort-------'--abort--> ENDED     '---resume------->|          upload   |
                                                                     |                   v
                                  (--stop) upload: DUMPED --> HELD   |               UPLOADED
                                   HELD --finish(stop)--> ENDED      |                   |
                                   HELD --resume--> RESUMED          '      finish --> ENDED

    `park` leaves PREPARED as it is when a rank did not park (the coordinator aborts). Ranks
    are held (must be resumed, or stopped) in SUSPENDED, DUMPED and HELD; they run in RESUMED
    and UPLOADED. When the lease runs out, or a newer coordinator appears, a freeze in
    PREPARED or PARKED is aborted, one whose ranks are held is resumed, and either way ENDED.
    """

    PREPARED = "prepared"
    PARKED = "parked"
    SUSPENDED = "suspended"
    DUMPED = "dumped"
    RESUMED = "resumed"
    UPLOADED = "uploaded"
    HELD = "held"
    ENDED = "ended"

    @property
    def ranks_held(self) -> bool:
        return self in (FreezePhase.SUSPENDED, FreezePhase.DUMPED, FreezePhase.HELD)


P = FreezePhase


@dataclass
class Freeze:
    freeze_id: str
    job_id: str
    work: Path
    phase: FreezePhase = P.PREPARED
    records: dict[int, common_pb2.RankRecord] = field(default_factory=dict)
    writer: SnapshotWriter | None = None
    written: list[StreamInfo] = field(default_factory=list)  # what the upload stored
    # GPU state checkpointed for the dump and not yet restored into the ranks.
    gpu: GpuHold | None = None
    # The lease: the coordinator's calls and keep-alives renew it; when it runs out with no
    # call in flight, the agent puts the ranks back on its own.
    touched: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    expired: bool = False  # its coordinator was replaced by a newer one
    # Set when a migration offers the dumped images to its target (agent/handoff.py).
    ticket: str = ""
    # Ranks a Resume of this freeze was asked to resume already (a migration of single ranks
    # resumes the others first, and the moving ones only if their move fails).
    resumed: set[int] = field(default_factory=set)
    # The job as this freeze found it. Once that job ended, the same id may name another (a
    # recovery thaws the job again on this node): the lease's recovery must never touch that.
    job: NodeJob | None = None


_SEEDS_KEPT = 64
# How long a refused prepare waits for this node's other ranks to let go of their hold: they
# answer from their control thread at once; one that does not lets go at its hold's deadline.
PREPARE_RELEASE_S = 5.0


def _raw_total(fr: Freeze) -> int:
    """The raw bytes the upload of `fr` stores: each rank's images as the tar stream the
    writer makes of them, deduplicated chunks included (0: not known)."""
    try:
        return sum(dirstream.tar_size(fr.work / r.stream) for r in fr.records.values())
    except OSError:
        return 0  # the upload itself then fails on the same tree and says why


class Freezes:
    """Every freeze in progress on this node, by freeze id."""

    def __init__(
        self,
        node: str,
        paths: Paths,
        store: ObjectStore,
        jobs: JobTable,
        gpu: Callable[[], GpuStage | None],
        node_env: Callable[[int], dict[str, str]],
        parallelism: int,
        lease_s: float,
        copies: LocalCopies | None = None,
    ) -> None:
        self.node = node
        self.copies = copies
        self.upload_nice = upload_nice()  # a bad setting stops the agent's start, not a freeze
        self.paths = paths
        self.store = store
        self.jobs = jobs
        self.gpu = gpu
        self.node_env = node_env
        self.parallelism = parallelism
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._freezes: dict[str, Freeze] = {}
        # Per job, the snapshot this node last uploaded to and saw committed, with its
        # streams: the next freeze's dedup seed, so its unchanged chunks cost no hashing beyond
        # xxh3 and no request (storage/dedup.py). Only committed chunks are trusted: those of a
        # freeze that failed are gc's to take.
        self._last_streams: dict[str, tuple[str, list[StreamInfo]]] = {}

    # ---- phases ----------------------------------------------------------------------------

    def prepare(self, job_id: str, freeze_id: str, timeout: float) -> agent_pb2.PrepareReply:
        job = self.jobs.running(job_id)
        criu.criu_binary()  # refuse before touching the ranks when the dump could not work
        # A progress sample holds the lock for a moment: a freeze waits that out (and is
        # refused only when another freeze or thaw holds it).
        if not job.op_lock.acquire(timeout=PROGRESS_HOLD_S):
            raise errors.FreezeRefused(
                f"another freeze or thaw of job {job_id} is in progress",
                "wait for it to finish (`snapshotter status`), then retry",
            )
        try:
            for r in job.ranks:
                r.channel.drain()
            counts = job.each(
                lambda r: r.channel.request(protocol.prepare(freeze_id), timeout)["counts"],
                self.parallelism,
            )
        except BaseException:
            # The ranks that did prepare hold every new collective (and every process group
            # being set up) until an abort or their hold's deadline: the coordinator aborts
            # only the nodes whose Prepare succeeded, so release this node's here. Without it
            # a rank refusing (it was in init_process_group) while its peer held made the
            # peer's own init wait out the hold, and a policy retrying every 5 s renewed it:
            # a job took 2 minutes to start.
            try:
                self._tell_abort(job, freeze_id, PREPARE_RELEASE_S)
            finally:
                job.op_lock.release()
            raise
        with self._lock:
            self._freezes[freeze_id] = Freeze(
                freeze_id, job_id, self.paths.work_dir(freeze_id), job=job
            )
        reply = agent_pb2.PrepareReply()
        for rank, c in counts.items():
            reply.counts[rank].issued.update({str(k): int(v) for k, v in c.items()})
        return reply

    def park(
        self, job_id: str, freeze_id: str, targets: dict[str, int], timeout: float
    ) -> agent_pb2.ParkReply:
        """Arm the barrier on every rank and wait until all parked or the deadline passed.
        Ranks that did not park are reported, not raised: the coordinator decides."""
        job = self.jobs.get(job_id)
        with self._driving(freeze_id, {P.PREPARED}) as fr:
            for r in job.ranks:
                r.channel.send(protocol.park(freeze_id, targets))
            deadline = time.monotonic() + timeout
            reply = agent_pb2.ParkReply()
            for r in job.ranks:
                try:
                    msg = r.channel.expect(
                        "parked", freeze_id, max(0.0, deadline - time.monotonic())
                    )
                    at = msg.get("at") or {}
                    reply.parked[r.rank].group = str(at.get("group", ""))
                    reply.parked[r.rank].seq = int(at.get("seq", 0))
                except errors.SnapshotterError as e:
                    reply.missing[r.rank] = e.cause
            self._describe_unparked(job, targets, reply)
            if not reply.missing:
                fr.phase = P.PARKED
            return reply

    @staticmethod
    def _describe_unparked(job: NodeJob, targets: dict[str, int],
                           reply: agent_pb2.ParkReply) -> None:  # fmt: skip
        """Say what each rank that did not park was doing: all asked at once, then answers
        awaited under one short deadline (the park's reply must not miss its own)."""
        seen = progress_all({r.rank: r.channel for r in job.ranks if r.rank in reply.missing},
                            WHERE_WAIT_S, where=True)  # fmt: skip
        for rank, why in list(reply.missing.items()):
            reply.missing[rank] = unparked(why, targets, seen.get(rank))

    def suspend(self, job_id: str, freeze_id: str, timeout: float) -> None:
        job = self.jobs.get(job_id)
        with self._driving(freeze_id, {P.PARKED}) as fr:
            fr.phase = P.SUSPENDED  # a failure half-way must be resumed too
            job.each(
                lambda r: r.channel.request(protocol.suspend(freeze_id), timeout),
                self.parallelism,
            )

    def abort(self, job_id: str, freeze_id: str, timeout: float = 30.0) -> agent_pb2.AbortReply:
        """Undo a park (communicators intact): every rank continues as before.

        Told to all at once, then the replies are awaited under one deadline. A rank that is
        stopped (SIGSTOP, a debugger) cannot answer: it is not waited for (its hook reads the
        abort when it runs again), so that the freeze fails at once and hang detection,
        which names that rank, looks again."""
        job = self.jobs.get(job_id)
        reply = self._tell_abort(job, freeze_id, timeout)
        self._end(job, freeze_id)
        return reply

    @staticmethod
    def _tell_abort(job: NodeJob, freeze_id: str, timeout: float) -> agent_pb2.AbortReply:
        """Tell every live rank to let go of `freeze_id` and await their answers under one
        deadline; the ranks that did not answer, with why."""
        reply = agent_pb2.AbortReply()
        told = []
        for r in job.alive_ranks():
            try:
                r.channel.send(protocol.abort(freeze_id))
                told.append(r)
            except errors.SnapshotterError as e:
                reply.failed[r.rank] = e.cause
        deadline = time.monotonic() + timeout
        for r in told:
            if rank_state(r) in STOPPED_STATES:
                reply.failed[r.rank] = (f"rank {r.rank} is stopped: it continues when it runs "
                                        "again")  # fmt: skip
                continue
            try:
                r.channel.expect(protocol.REPLY_TO[protocol.ABORT], freeze_id,
                                 max(0.0, deadline - time.monotonic()))  # fmt: skip
            except errors.SnapshotterError as e:
                reply.failed[r.rank] = e.cause
        return reply

    def dump(
        self, job_id: str, freeze_id: str, only: set[int] | None = None
    ) -> agent_pb2.DumpReply:
        """CRIU-dump the ranks (`only` those, for a migration of single ranks), leaving them
        running but parked."""
        job = self.jobs.get(job_id)
        if only is not None and not only <= {r.rank for r in job.ranks}:
            raise errors.InvalidArgument(
                f"rank(s) {sorted(only - {r.rank for r in job.ranks})} of job {job_id} do not "
                f"run on node {self.node}", "check the job's placement (`snapshotter status`)",
            )  # fmt: skip
        with self._driving(freeze_id, {P.SUSPENDED}) as fr:
            fr.work.mkdir(parents=True, exist_ok=True)
            logs = self.paths.criu_logs(freeze_id)

            def one(r: RankRuntime) -> common_pb2.RankRecord:
                images = fr.work / f"rank-{r.rank}"
                images.mkdir(parents=True, exist_ok=True)
                t0, start = time.monotonic(), time.time()
                criu.dump(
                    r.sandbox.pid, images, leave_running=True, log_dir=logs / images.name,
                    while_stopped=lambda img: files.keep_written_files(img, [str(PRIVATE_TMP)]),
                )  # fmt: skip
                rec = common_pb2.RankRecord(
                    rank=r.rank,
                    local_rank=r.placement.local_rank,
                    node_rank=r.placement.node_rank,
                    stream=images.name,
                    inodes=dict(r.sandbox.io.inodes),
                    init_cwd=r.init_cwd,
                    image_bytes=sum(f.stat().st_size for f in images.rglob("*") if f.is_file()),
                    dump_s=time.monotonic() - t0,
                    dump_start=start,
                    dump_end=time.time(),
                )
                fr.records[r.rank] = rec
                return rec

            # GPU state goes to host memory first, so that CRIU dumps it with the process.
            stage = self.gpu()
            if stage is not None:
                fr.gpu = stage.freeze({r.rank: r.sandbox.pid for r in job.alive_ranks()
                                       if only is None or r.rank in only})  # fmt: skip
            try:
                recs = job.each(one, self.parallelism, only)
            except BaseException:
                self._gpu_release(fr)  # the coordinator resumes the ranks next
                raise
            if fr.gpu is not None:
                for rank, rg in fr.gpu.ranks.items():
                    if rank in recs and rg.procs:
                        recs[rank].gpu.CopyFrom(convert.parse(rg.record(), common_pb2.GpuRecord))
            fr.phase = P.DUMPED
            return agent_pb2.DumpReply(ranks=[recs[k] for k in sorted(recs)])

    def resume(
        self, job_id: str, freeze_id: str, timeout: float, plane: int | None = None,
        skip: frozenset[int] = frozenset(),
    ) -> None:  # fmt: skip
        """Ranks rebuild their communicators and go on (on data-link `plane`, when given),
        but those in `skip`, which a migration moves away: a later call resumes those after
        all (their move failed). With --stop the ranks are stopped after the commit and this
        is never called; a failed --stop freeze resumes here, so its GPU state comes back."""
        job = self.jobs.get(job_id)
        allowed = {P.SUSPENDED, P.DUMPED, P.HELD, P.RESUMED}
        with self._driving(freeze_id, allowed, must_exist=False) as fr:
            todo = {r.rank for r in job.ranks} - set(skip)
            if fr is not None:
                with self._lock:
                    todo -= fr.resumed
                    fr.resumed |= todo
                if fr.phase is P.RESUMED and not todo:
                    raise errors.FreezeFailed(
                        f"freeze {freeze_id} on node {self.node} is resumed already",
                        "the coordinator and this agent disagree; retry the freeze",
                    )
                held = set(fr.gpu.ranks) if fr.gpu is not None else set()
                if held <= todo:
                    self._gpu_release(fr)
            if plane is not None:
                job.plane = plane
            self.resume_ranks(job, job.rdzv_address, freeze_id, timeout, todo)
            if fr is not None and not skip:
                fr.phase = P.RESUMED

    def offer(self, job_id: str, freeze_id: str, ticket: str) -> None:
        """Let the migration's target read this dumped freeze's images with `ticket`."""
        self.jobs.get(job_id)
        with self._driving(freeze_id, {P.DUMPED}) as fr:
            fr.ticket = ticket

    def images(
        self, job_id: str, freeze_id: str, ticket: str, stream: str
    ) -> Iterator[agent_pb2.ImagePiece]:
        """One rank's dumped images, for the target of a migration."""
        with self._driving(freeze_id, {P.DUMPED}) as fr:
            handoff.check_ticket(fr.ticket, ticket, self.node)
            if fr.job_id != job_id or stream not in {r.stream for r in fr.records.values()}:
                raise errors.InvalidArgument(
                    f"freeze {freeze_id} of job {job_id} on node {self.node} dumped no rank "
                    f"images {stream!r}",
                    "ask for the streams the coordinator named",
                )
            yield from handoff.pieces(fr.work / stream)

    def upload(
        self, job_id: str, freeze_id: str, snapshot_id: str, seal: Seal | None = None
    ) -> Iterator[agent_pb2.UploadEvent]:
        """`seal`: the tenant data key every chunk is sealed with (encryption at rest)."""
        with self._driving(freeze_id, {P.DUMPED, P.RESUMED}) as fr:
            yield from self._upload(fr, snapshot_id, seal)
            fr.phase = P.UPLOADED if fr.phase is P.RESUMED else P.HELD

    def _upload(
        self, fr: Freeze, snapshot_id: str, seal: Seal | None
    ) -> Iterator[agent_pb2.UploadEvent]:
        events: list[agent_pb2.UploadEvent] = []
        cv = threading.Condition()
        result: dict[str, object] = {}
        total = 0  # raw bytes of all this node's streams, known before the first chunk

        def progress(p: Progress) -> None:
            ev = agent_pb2.UploadEvent(
                progress=common_pb2.TransferProgress(
                    node=self.node, stream=p.stream, raw_bytes=p.total_raw_bytes,
                    stored_bytes=p.total_stored_bytes, rate=p.raw_rate,
                    uploaded_bytes=p.uploaded_bytes,
                    # Never below what was counted: a tree changed since it was measured.
                    total_bytes=max(total, p.total_raw_bytes) if total else 0,
                )
            )  # fmt: skip
            with cv:
                events.append(ev)
                cv.notify_all()

        # With the job training on (freeze-and-continue), the upload is background work: its
        # threads (this one and the ones it starts) yield the CPU to the ranks.
        background = fr.phase is P.RESUMED

        def work() -> None:
            nonlocal total
            try:
                if background:
                    lower_this_thread(self.upload_nice)
                total = _raw_total(fr)
                seed = self._seed(fr.job_id)
                writer = SnapshotWriter(self.store, snapshot_id, progress=progress, seed=seed,
                                        seal=seal)  # fmt: skip
                fr.writer = writer
                t0 = time.time()
                done = agent_pb2.Uploaded()
                written = []
                for rank in sorted(fr.records):
                    stream = fr.records[rank].stream
                    info = writer.add_directory(stream, fr.work / stream)
                    written.append(info)
                    done.streams[stream].CopyFrom(
                        convert.parse(info.to_dict(), common_pb2.StreamInfo)
                    )
                fr.written = written
                done.ranks.extend(fr.records[k] for k in sorted(fr.records))
                done.put_keys.extend(writer.put_keys)
                done.upload.CopyFrom(
                    common_pb2.UploadWindow(
                        node=self.node, start=t0, end=time.time(),
                        uploaded_bytes=writer.uploaded_bytes,
                        deduped_chunks=writer.deduped_chunks,
                        uploaded_chunks=writer.uploaded_chunks,
                    )
                )  # fmt: skip
                result["done"] = agent_pb2.UploadEvent(uploaded=done)
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                result["error"] = e
            finally:
                with cv:
                    result["finished"] = True
                    cv.notify_all()

        threading.Thread(target=work, daemon=True, name=f"upload-{fr.freeze_id}").start()
        sent = 0
        try:
            while True:
                with cv:
                    while sent == len(events) and "finished" not in result:
                        cv.wait(1.0)
                    batch, sent = events[sent:], len(events)
                    finished = "finished" in result
                if batch:  # progress is sampled: the latest event is enough for a progress line
                    yield batch[-1]
                if finished:
                    break
        except GeneratorExit:
            # The coordinator went away mid-upload (the stream was dropped): no commit can
            # include this node's chunks now, so stop writing and delete them.
            if "finished" not in result and fr.writer is not None:
                log.warning("upload of freeze %s abandoned by the coordinator", fr.freeze_id)
                fr.writer.abort()
            raise
        if "error" in result:
            raise result["error"]  # type: ignore[misc]
        yield result["done"]  # type: ignore[misc]

    def _seed(self, job_id: str) -> list[StreamInfo]:
        """The job's last committed streams on this node, while that snapshot still exists
        (its chunks are then referenced, and gc keeps them)."""
        with self._lock:
            last = self._last_streams.get(job_id)
        if last is None:
            return []
        try:
            if self.store.head(fmt.manifest_key(last[0])) is not None:
                return last[1]
        except errors.StorageUnavailable:
            pass  # the upload will say so itself
        with self._lock:
            self._last_streams.pop(job_id, None)
        return []

    def discard_upload(self, freeze_id: str) -> None:
        """Delete the chunks this node wrote for a snapshot that will not be committed."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
        if fr is not None and fr.writer is not None:
            fr.writer.abort()

    def finish(
        self, job_id: str, freeze_id: str, stop: bool, committed: bool = False,
        stop_ranks: frozenset[int] = frozenset(),
    ) -> NodeJob:  # fmt: skip
        """The freeze is over (`committed`: its snapshot was committed, so the node keeps the
        images as the job's local copy for a thaw here). `stop_ranks` end, and leave the job
        here, without failing it: a migration restored them on another node."""
        job = self.jobs.get(job_id)
        with self._lock:
            fr = self._freezes.get(freeze_id)
        if stop_ranks:
            if fr is not None:
                fr.gpu = None  # only the moved ranks were checkpointed: they end as they are
            job.let_go(set(stop_ranks))
        if committed and fr is not None and fr.writer is not None and fr.written:
            with self._lock:
                self._last_streams.pop(job_id, None)
                self._last_streams[job_id] = (fr.writer.snapshot_id, fr.written)
                while len(self._last_streams) > _SEEDS_KEPT:  # the oldest jobs' go first
                    del self._last_streams[next(iter(self._last_streams))]
        if committed and fr is not None and fr.writer is not None and self.copies is not None:
            streams = [fr.records[k].stream for k in sorted(fr.records)]
            self.copies.keep(job_id, fr.writer.snapshot_id, fr.work, streams)
        if stop:
            job.stop(NodeJobState.FROZEN)  # GPU state still checkpointed: nothing to restore
        elif fr is not None:
            self._gpu_release(fr)
        self._end(job, freeze_id)
        return job

    def keep(self, freeze_id: str) -> bool:
        """The coordinator still drives this freeze (sent while other nodes work)."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
            if fr is not None:
                fr.touched = time.monotonic()
        return fr is not None

    def expire_all(self) -> None:
        """A newer coordinator took over: freezes of the old one end now (the lease check
        puts their ranks back as soon as no call of theirs is in flight)."""
        with self._lock:
            for fr in self._freezes.values():
                fr.expired = True

    def live_ids(self) -> set[str]:
        with self._lock:
            return set(self._freezes)

    def resume_ranks(
        self, job: NodeJob, rdzv: RdzvAddress, epoch: str, timeout: float,
        only: set[int] | None = None,
    ) -> None:  # fmt: skip
        """Every rank (`only` those) rebuilds its communicators against `rdzv` under `epoch`,
        with this node's network settings."""
        env = resume_env(rdzv, self.node_env(job.plane))
        job.each(
            lambda r: r.channel.request(
                protocol.resume(epoch, epoch, rdzv.host, rdzv.port, env), timeout
            ),
            self.parallelism,
            only,
        )

    # ---- the lease ---------------------------------------------------------------------------

    def check_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [
                f for f in self._freezes.values()
                if f.in_flight == 0 and (f.expired or now - f.touched > self.lease_s)
            ]  # fmt: skip
        for fr in due:
            try:
                self._abandon(fr)
            except Exception as e:  # noqa: BLE001 - the watchdog must keep running
                if isinstance(e, errors.SnapshotterError):  # a known cause: say it, no trace
                    log.error("recovering abandoned freeze %s failed: %s", fr.freeze_id, e)
                else:
                    log.exception("recovering abandoned freeze %s failed", fr.freeze_id)
                with self._lock:
                    self._freezes.pop(fr.freeze_id, None)  # once: never retried
                if fr.writer is not None:
                    fr.writer.release()

    def _abandon(self, fr: Freeze) -> None:
        """The coordinator stopped driving this freeze: put the ranks back as they were.
        Chunks already uploaded stay (a manifest may have been written after all): without a
        manifest they are orphans for `snapshotter gc`."""
        log.warning(
            "freeze %s of job %s: no word from the coordinator for %.0fs; %s",
            fr.freeze_id, fr.job_id, self.lease_s,
            "resuming the ranks" if fr.phase.ranks_held else "releasing the ranks",
        )  # fmt: skip
        job = fr.job if fr.job is not None else self.jobs.get(fr.job_id)
        if job.state.terminal or len(job.alive_ranks()) != len(job.ranks):
            job.stop(NodeJobState.FAILED)  # nothing left to put back
            self._end(job, fr.freeze_id)
        elif fr.phase.ranks_held:
            self._gpu_release(fr)
            # Every node's agent recovers the same way, so all ranks meet under one epoch.
            self.resume_ranks(job, job.rdzv_address, f"{fr.freeze_id}-recovered", 300.0)
            self._end(job, fr.freeze_id)
        elif fr.phase in (P.PREPARED, P.PARKED):
            self.abort(fr.job_id, fr.freeze_id)
        else:
            self._end(job, fr.freeze_id)

    # ---- helpers -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _driving(
        self, freeze_id: str, allowed: set[FreezePhase], must_exist: bool = True
    ) -> Iterator[Freeze]:
        """A coordinator call on a freeze in one of the `allowed` phases: the lease does not
        run out while it is in flight."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
            if fr is not None:
                if fr.phase not in allowed:
                    raise errors.FreezeFailed(
                        f"freeze {freeze_id} on node {self.node} is {fr.phase.value}, not "
                        f"{' or '.join(sorted(p.value for p in allowed))}",
                        "the coordinator and this agent disagree; retry the freeze",
                    )
                fr.in_flight += 1
                fr.touched = time.monotonic()
        if fr is None:
            if must_exist:
                raise errors.FreezeFailed(
                    f"unknown freeze {freeze_id} on node {self.node}",
                    "the agent restarted during the freeze, or its lease ran out; retry it",
                )
            yield None  # type: ignore[misc]
            return
        try:
            yield fr
        finally:
            with self._lock:
                fr.in_flight -= 1
                fr.touched = time.monotonic()

    def _gpu_release(self, fr: Freeze) -> None:
        """Put GPU state checkpointed for a dump back into the ranks (before they resume)."""
        hold, fr.gpu = fr.gpu, None
        stage = self.gpu()
        if hold is not None and stage is not None:
            stage.release(hold)

    def _end(self, job: NodeJob, freeze_id: str) -> None:
        """Release everything a freeze holds, whichever way it ended. Chunks it uploaded stay:
        committed, discarded (DiscardUpload) or left for gc, the coordinator decides."""
        with self._lock:
            fr = self._freezes.pop(freeze_id, None)
        if fr is not None:
            fr.phase = P.ENDED
            if fr.writer is not None:
                fr.writer.release()
            shutil.rmtree(fr.work, ignore_errors=True)
        if job.op_lock.locked():
            job.op_lock.release()
