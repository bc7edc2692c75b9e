"""The node agent: owns the rank processes of its node and checkpoints them.

The coordinator drives a freeze in phases (prepare -> park -> suspend -> dump -> resume/upload
-> stop) so that many agents stay in step; each phase here acts on all local ranks in parallel.
The agent never decides whether a freeze goes on; it reports and the coordinator decides.
It must never leave a rank parked or suspended when a phase fails: it reports, and the
coordinator's abort/resume puts the ranks back.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.agent import retention
from snapshotter.agent.logs import LogPump, follow_file
from snapshotter.agent.orphans import forget, reap_orphans, record
from snapshotter.agent.rankctl import RankChannel
from snapshotter.agent.retention import Retention
from snapshotter.agent.runtime import NodeJob, NodeJobState, RankRuntime
from snapshotter.agent.storeserver import StoreServer
from snapshotter.config import Paths
from snapshotter.gpu import auto_stage
from snapshotter.gpu.stage import GpuHold, GpuStage, records_of
from snapshotter.launch.env import (
    RankPlacement,
    StoreAddress,
    placements,
    rank_argv,
    rank_env,
    resume_env,
)
from snapshotter.launch.spec import JobSpec
from snapshotter.procutil import Resources, resources
from snapshotter.rpc.wire import caller_active
from snapshotter.sandbox import children, criu
from snapshotter.sandbox.spawn import PRIVATE_TMP, Sandbox, become_subreaper, spawn
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.transfer import Progress, SnapshotReader, SnapshotWriter

log = logging.getLogger(__name__)

Msg = dict[str, Any]


@dataclass
class _Freeze:
    freeze_id: str
    job_id: str
    work: Path
    records: dict[int, Msg] = field(default_factory=dict)
    writer: SnapshotWriter | None = None
    # GPU state checkpointed for the dump and not yet restored into the ranks.
    gpu: GpuHold | None = None
    # The lease: the coordinator's calls and keep-alives renew it; when it runs out with no
    # call in flight, the agent puts the ranks back on its own (the coordinator died).
    touched: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    suspended: bool = False
    resumed: bool = False
    expired: bool = False  # its coordinator was replaced by a newer one


@dataclass(frozen=True)
class NodeSettings:
    name: str
    paths: Paths
    # Address ranks of this node use to reach the job's store (the node's own address).
    host: str = "127.0.0.1"
    # Network settings of this node that ranks must use, also after a thaw onto it.
    network_env: tuple[tuple[str, str], ...] = ()
    netns: str | None = None
    dump_parallelism: int = 8
    # Each sandbox gets a private TMPDIR (its own mount namespace, dumped with it): forks of
    # one snapshot on one node do not share multiprocessing's listener sockets (a fork would
    # otherwise break the original's DataLoader), and a rank's temp files travel with it.
    # The price: a restore needs the target node to have the same mounts.
    private_tmp: bool = True
    # Builds this node's GPU stage (None: none). Unset: the real driver when there is one.
    gpu: Callable[[], GpuStage | None] | None = None
    # Seconds a freeze may go without any call or keep-alive from the coordinator before the
    # agent gives up on it and resumes (or unparks) its ranks; 0 disables the watchdog.
    freeze_lease_s: float = 60.0
    # What finished jobs, logs and abandoned operations the agent keeps (agent/retention.py).
    retention: Retention = field(default_factory=Retention)
    # How often the agent reaps stray children and applies the retention bounds.
    housekeeping_s: float = 10.0


class NodeAgent:
    def __init__(self, settings: NodeSettings, store: ObjectStore) -> None:
        self.settings = settings
        self.paths = settings.paths
        self.store = store
        self._jobs: dict[str, NodeJob] = {}
        self._freezes: dict[str, _Freeze] = {}
        self._lock = threading.Lock()
        # Stores opened for jobs about to launch or thaw here as node 0 (by job id).
        self._stores: dict[str, StoreServer] = {}
        self._gpu_stage: GpuStage | None = None
        self._gpu_checked = False
        self._closed = threading.Event()
        # Ops with no call in flight that a dead coordinator could leave behind, by when they
        # began (monotonic): thaws fetched here, stores opened here (agent/retention.py).
        self._fetched: dict[str, float] = {}
        self._store_opened: dict[str, float] = {}
        # Launches in progress (job id -> cancelled?): a Cancel can stop one half-way.
        self._launching: dict[str, threading.Event] = {}
        # Init working directories of live ranks: how many use each, and whether this agent
        # made it (it then removes it when the last user ends).
        self._init_cwds: dict[str, tuple[int, bool]] = {}
        self.incarnation = uuid.uuid4().hex[:12]
        become_subreaper()
        self._sandboxes = self.paths.home / "sandboxes"
        reap_orphans(self._sandboxes)
        # No operation outlives the agent that ran it: what a previous one staged is garbage.
        shutil.rmtree(self.paths.home / "work", ignore_errors=True)
        self._maintainer = threading.Thread(target=self._maintain, daemon=True, name="maintain")
        self._maintainer.start()

    # ----------------------------------------------------------------- helpers
    @property
    def node_env(self) -> dict[str, str]:
        return dict(self.settings.network_env)

    def job(self, job_id: str) -> NodeJob:
        with self._lock:
            j = self._jobs.get(job_id)
        if j is None:
            raise errors.JobNotFound(job_id)
        return j

    def _running(self, job_id: str) -> NodeJob:
        j = self.job(job_id)
        if j.state is not NodeJobState.RUNNING:
            raise errors.JobNotRunning(
                f"job {job_id} is {j.state.value}, not running",
                "only a running job can be frozen; `snapshotter list` shows its snapshots",
            )
        return j

    def _gpu(self) -> GpuStage | None:
        """This node's GPU stage, found once (no driver: None, logged once by auto_stage)."""
        with self._lock:
            if not self._gpu_checked:
                make = self.settings.gpu or auto_stage
                self._gpu_stage = make()
                self._gpu_checked = True
            return self._gpu_stage

    def _gpu_release(self, freeze_id: str) -> None:
        """Put GPU state checkpointed for a dump back into the ranks (before they resume)."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
            hold = fr.gpu if fr is not None else None
            if fr is not None:
                fr.gpu = None
        stage = self._gpu()
        if hold is not None and stage is not None:
            stage.release(hold)

    def _pool(self, n: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=max(1, min(n, self.settings.dump_parallelism)))

    def _new_rank(
        self, p: RankPlacement, sandbox: Sandbox, job_id: str, init_cwd: str, made_cwd: bool
    ) -> RankRuntime:
        """Hand a started or restored sandbox to a RankRuntime, which owns it from now on."""
        record(self._sandboxes, sandbox.pid)
        ctl_in, ctl_out, out, err = sandbox.io.take("ctl_in", "ctl_out", "stdout", "stderr")
        rt = RankRuntime(
            placement=p,
            sandbox=sandbox,
            channel=RankChannel(p.rank, ctl_in, ctl_out),
            pump=LogPump(self.paths.log_file(job_id, p.rank), [out, err]),
            init_cwd=init_cwd,
        )
        pid = sandbox.pid
        rt.cleanups.append(lambda: forget(self._sandboxes, pid))
        with self._lock:
            users, made = self._init_cwds.get(init_cwd, (0, False))
            self._init_cwds[init_cwd] = (users + 1, made or made_cwd)
        rt.cleanups.append(lambda: self._release_init_cwd(init_cwd))
        return rt

    def _release_init_cwd(self, path: str) -> None:
        """Remove an init working directory this agent made, once none of its live ranks
        uses it (a fork restored on this node shares its original's)."""
        with self._lock:
            users, made = self._init_cwds.pop(path, (1, False))
            if users > 1:
                self._init_cwds[path] = (users - 1, made)
                return
        if made:
            shutil.rmtree(path, ignore_errors=True)

    def _register(self, job: NodeJob) -> None:
        with self._lock:
            old = self._jobs.get(job.spec.job_id)
            if old is not None and not old.state.terminal:
                raise errors.InvalidArgument(
                    f"job {job.spec.job_id} is already running on node {self.settings.name}",
                    "choose another --job-id",
                )
            self._jobs[job.spec.job_id] = job

    # ----------------------------------------------------------------- stores
    def open_store(self, job_id: str, python: str, env: dict[str, str]) -> Msg:
        """Start the rendezvous store of a job about to launch or thaw with this node as node
        0; the coordinator hands its address to every node's Launch/Restore."""
        server = StoreServer(python, self.settings.host, env)
        try:
            addr = server.address
        except BaseException:
            server.stop()
            raise
        with self._lock:
            old = self._stores.pop(job_id, None)
            self._stores[job_id] = server
            self._store_opened[job_id] = time.monotonic()
        if old is not None:
            old.stop()
        return {"host": addr.host, "port": addr.port}

    def close_store(self, job_id: str) -> Msg:
        """Stop a store opened for a launch or thaw that did not happen."""
        with self._lock:
            server = self._stores.pop(job_id, None)
            self._store_opened.pop(job_id, None)
        if server is not None:
            server.stop()
        return {}

    def _store_for(
        self, spec: JobSpec, store: StoreAddress | None
    ) -> tuple[StoreServer | None, StoreAddress | None]:
        """The job's store on this node: the one opened for it here (node 0), or a new one
        when none is named (a caller driving one node alone), or only node 0's address."""
        with self._lock:
            opened = self._stores.pop(spec.job_id, None)
            self._store_opened.pop(spec.job_id, None)
        if opened is not None:
            return opened, None
        if store is None:
            return StoreServer(spec.python, self.settings.host, spec.env), None
        return None, store

    # ----------------------------------------------------------------- launch
    def launch(self, spec: JobSpec, node_rank: int, store_at: StoreAddress | None = None) -> Msg:
        """Start this node's ranks of a job. All or nothing: whatever fails (a spawn, a Cancel
        arriving meanwhile, the caller giving up), every sandbox started is killed and reaped
        and the job's store stopped before the error is raised."""
        cancelled = threading.Event()
        with self._lock:
            old = self._jobs.get(spec.job_id)
            if (old is not None and not old.state.terminal) or spec.job_id in self._launching:
                raise errors.InvalidArgument(
                    f"job {spec.job_id} is already running", "choose another --job-id"
                )
            self._launching[spec.job_id] = cancelled
        try:
            store, remote = self._store_for(spec, store_at)
            job = NodeJob(spec=spec, node_rank=node_rank, store=store, remote_store=remote)
            init_cwd: Path | None = None
            try:
                for p in placements(spec.nnodes, spec.nproc_per_node, node_rank):
                    self._check_launch(spec.job_id, cancelled)
                    env = rank_env(spec.env, p, job.store_address, spec.job_id, self.node_env)
                    argv = rank_argv(spec.python, spec.script, spec.script_args, spec.module)
                    init_cwd = self.paths.init_cwd(
                        f"{spec.job_id}-r{p.rank}-{uuid.uuid4().hex[:8]}"
                    )
                    sb = spawn(
                        argv,
                        env,
                        spec.cwd,
                        init_cwd=init_cwd,
                        netns=self.settings.netns,
                        private_tmp=PRIVATE_TMP if self.settings.private_tmp else None,
                    )
                    job.ranks.append(self._new_rank(p, sb, spec.job_id, str(init_cwd), True))
                    init_cwd = None  # owned by the rank now
                self._check_launch(spec.job_id, cancelled)
            except BaseException as e:
                if init_cwd is not None:  # made for a spawn that failed
                    shutil.rmtree(init_cwd, ignore_errors=True)
                self._undo_launch(job, e)
                raise
            self._register(job)
        finally:
            with self._lock:
                self._launching.pop(spec.job_id, None)
        job.watch()
        return job.describe()

    def _check_launch(self, job_id: str, cancelled: threading.Event) -> None:
        if cancelled.is_set():
            raise errors.FreezeRefused(
                f"the launch of job {job_id} was cancelled while it started its ranks",
                "nothing of it is left running; launch it again if that was not meant",
            )
        if not caller_active():
            raise errors.ServiceUnavailable(
                f"the caller gave up on the launch of job {job_id} (its deadline passed)",
                "nothing of it is left running; retry the launch",
            )

    def _undo_launch(self, job: NodeJob, cause: BaseException) -> None:
        log.warning(
            "launch of job %s on node %s failed (%s); ending the %d rank(s) it started",
            job.spec.job_id, self.settings.name, cause, len(job.ranks),
        )  # fmt: skip
        for r in job.ranks:
            r.sandbox.kill()
        for r in job.ranks:
            r.sandbox.wait(30)
        job.release()

    # ----------------------------------------------------------------- freeze phases
    def _each(self, job: NodeJob, fn: Callable[[RankRuntime], Msg]) -> dict[int, Msg]:
        ranks = job.alive_ranks()
        if len(ranks) != len(job.ranks):
            gone = [r.rank for r in job.ranks if r.exit_code is not None]
            raise errors.FreezeFailed(
                f"rank(s) {gone} of job {job.spec.job_id} have exited",
                "see `snapshotter logs`; a job with dead ranks cannot be frozen",
            )
        with self._pool(len(ranks)) as pool:
            futs = {r.rank: pool.submit(fn, r) for r in ranks}
            out: dict[int, Msg] = {}
            first: BaseException | None = None
            for rank, f in futs.items():
                try:
                    out[rank] = f.result()
                except BaseException as e:  # noqa: BLE001 - first failure is re-raised below
                    first = first or e
            if first is not None:
                raise first
            return out

    def prepare(self, job_id: str, freeze_id: str, timeout: float) -> Msg:
        job = self._running(job_id)
        # Refuse before touching the ranks when the dump could not work anyway.
        criu.criu_binary()
        if not job.op_lock.acquire(blocking=False):
            raise errors.FreezeRefused(
                f"another freeze or thaw of job {job_id} is in progress",
                "wait for it to finish (`snapshotter status`), then retry",
            )
        try:
            for r in job.ranks:
                r.channel.drain()
            counts = self._each(
                job,
                lambda r: r.channel.request(
                    {"op": "prepare", "freeze": freeze_id}, "counts", timeout
                )["counts"],
            )
        except BaseException:
            job.op_lock.release()
            raise
        work = self.paths.work_dir(freeze_id)
        with self._lock:
            self._freezes[freeze_id] = _Freeze(freeze_id=freeze_id, job_id=job_id, work=work)
        return {"counts": {str(k): v for k, v in counts.items()}}

    def park(self, job_id: str, freeze_id: str, targets: dict[str, int], timeout: float) -> Msg:
        """Arm the barrier on every rank and wait until all are parked or the deadline passes.
        Ranks that did not park are reported, not raised: the coordinator decides to abort."""
        job = self.job(job_id)
        with self._driving(freeze_id):
            return self._park(job, freeze_id, targets, timeout)

    def _park(self, job: NodeJob, freeze_id: str, targets: dict[str, int], timeout: float) -> Msg:
        for r in job.ranks:
            r.channel.send({"op": "park", "freeze": freeze_id, "targets": targets})
        deadline = time.monotonic() + timeout
        parked: dict[str, Any] = {}
        missing: dict[str, str] = {}
        for r in job.ranks:
            try:
                msg = r.channel.expect("parked", freeze_id, max(0.0, deadline - time.monotonic()))
                parked[str(r.rank)] = msg.get("at")
            except errors.SnapshotterError as e:
                missing[str(r.rank)] = e.cause
        return {"parked": parked, "missing": missing}

    def suspend(self, job_id: str, freeze_id: str, timeout: float) -> Msg:
        job = self.job(job_id)
        with self._driving(freeze_id) as fr:
            fr.suspended = True  # a failure half-way must be resumed too
            self._each(
                job,
                lambda r: r.channel.request(
                    {"op": "suspend", "freeze": freeze_id}, "suspended", timeout
                ),
            )
        return {}

    def abort(self, job_id: str, freeze_id: str, timeout: float = 30.0) -> Msg:
        """Undo park (communicators intact): every rank continues as before."""
        job = self.job(job_id)
        failed: dict[str, str] = {}
        for r in job.alive_ranks():
            try:
                r.channel.request({"op": "abort", "freeze": freeze_id}, "aborted", timeout)
            except errors.SnapshotterError as e:
                failed[str(r.rank)] = e.cause
        self._end_freeze(job, freeze_id)
        return {"failed": failed}

    def dump(self, job_id: str, freeze_id: str) -> Msg:
        job = self.job(job_id)
        with self._driving(freeze_id) as fr:
            return self._dump(job, fr)

    def _dump(self, job: NodeJob, fr: _Freeze) -> Msg:
        freeze_id = fr.freeze_id
        fr.work.mkdir(parents=True, exist_ok=True)
        logs = self.paths.criu_logs(freeze_id)

        def one(r: RankRuntime) -> Msg:
            images = fr.work / f"rank-{r.rank}"
            images.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            criu.dump(r.sandbox.pid, images, leave_running=True, log_dir=logs / f"rank-{r.rank}")
            size = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
            rec = {
                "rank": r.rank,
                "local_rank": r.placement.local_rank,
                "node_rank": r.placement.node_rank,
                "stream": f"rank-{r.rank}",
                "inodes": dict(r.sandbox.io.inodes),
                "init_cwd": r.init_cwd,
                "image_bytes": size,
                "dump_s": time.monotonic() - t0,
            }
            fr.records[r.rank] = rec
            return rec

        # GPU state goes to host memory first, so that CRIU dumps it with the process.
        gpu = self._gpu()
        if gpu is not None:
            fr.gpu = gpu.freeze({r.rank: r.sandbox.pid for r in job.alive_ranks()})
        try:
            recs = self._each(job, one)
        except BaseException:
            self._gpu_release(freeze_id)  # the coordinator resumes the ranks next
            raise
        if fr.gpu is not None:
            for rank, rg in fr.gpu.ranks.items():
                if rank in recs and rg.procs:
                    recs[rank]["gpu"] = rg.record()
        return {"ranks": [recs[k] for k in sorted(recs)]}

    def resume(self, job_id: str, freeze_id: str, timeout: float) -> Msg:
        job = self.job(job_id)
        # With --stop the ranks are killed after the commit and this is never called; a
        # failed --stop freeze resumes through here, so its GPU state comes back too.
        with self._driving(freeze_id, must_exist=False) as fr:
            self._gpu_release(freeze_id)
            self._resume_ranks(job, job.store_address, freeze_id, timeout)
            if fr is not None:
                fr.resumed = True
        return {}

    def upload(self, job_id: str, freeze_id: str, snapshot_id: str) -> Iterator[Msg]:
        with self._driving(freeze_id) as fr:
            yield from self._upload(fr, snapshot_id)

    def _upload(self, fr: _Freeze, snapshot_id: str) -> Iterator[Msg]:
        freeze_id = fr.freeze_id
        events: list[Msg] = []
        ev_lock = threading.Condition()
        result: dict[str, Any] = {}

        def progress(p: Progress) -> None:
            ev = {
                "event": "progress",
                "node": self.settings.name,
                "stream": p.stream,
                "raw_bytes": p.total_raw_bytes,
                "stored_bytes": p.total_stored_bytes,
                "rate": p.raw_rate,
            }
            with ev_lock:
                events.append(ev)
                ev_lock.notify_all()

        def work() -> None:
            try:
                writer = SnapshotWriter(self.store, snapshot_id, progress=progress)
                fr.writer = writer
                t0 = time.time()
                streams = {}
                for rank in sorted(fr.records):
                    rec = fr.records[rank]
                    streams[rec["stream"]] = writer.add_directory(
                        rec["stream"], fr.work / f"rank-{rank}"
                    )
                result["streams"] = {k: v.to_dict() for k, v in streams.items()}
                result["upload"] = {"node": self.settings.name, "start": t0, "end": time.time()}
            except BaseException as e:  # noqa: BLE001 - handed to the caller below
                result["error"] = e
            finally:
                with ev_lock:
                    result["done"] = True
                    ev_lock.notify_all()

        threading.Thread(target=work, daemon=True, name=f"upload-{freeze_id}").start()
        try:
            yield from self._upload_events(fr, events, ev_lock, result)
        except GeneratorExit:
            # The coordinator went away mid-upload (the stream was dropped): no commit can
            # include this node's chunks now, so stop writing and delete them.
            if "done" not in result and fr.writer is not None:
                log.warning("upload of freeze %s abandoned by the coordinator", freeze_id)
                fr.writer.abort()
            raise

    def _upload_events(
        self, fr: _Freeze, events: list[Msg], ev_lock: threading.Condition, result: dict[str, Any]
    ) -> Iterator[Msg]:
        sent = 0
        while True:
            with ev_lock:
                while sent == len(events) and "done" not in result:
                    ev_lock.wait(1.0)
                batch = events[sent:]
                sent = len(events)
                done = "done" in result
            # Progress is sampled: the latest event is enough for a progress line.
            if batch:
                yield batch[-1]
            if done:
                break
        if "error" in result:
            raise result["error"]
        yield {
            "event": "uploaded",
            "streams": result["streams"],
            "ranks": [fr.records[k] for k in sorted(fr.records)],
            "upload": result["upload"],
        }

    def discard_upload(self, job_id: str, freeze_id: str) -> Msg:
        """Delete chunks this node wrote for a snapshot that will not be committed."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
        if fr is not None and fr.writer is not None:
            fr.writer.abort()
        return {}

    def finish_freeze(self, job_id: str, freeze_id: str, stop: bool) -> Msg:
        job = self.job(job_id)
        if stop:
            job.stop(NodeJobState.FROZEN)  # GPU state still checkpointed: nothing to restore
        else:
            self._gpu_release(freeze_id)
        self._end_freeze(job, freeze_id)
        return job.describe()

    def keep_freeze(self, job_id: str, freeze_id: str) -> Msg:
        """The coordinator is still driving this freeze (sent while other nodes work)."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
            if fr is not None:
                fr.touched = time.monotonic()
        return {"known": fr is not None}

    def expire_freezes(self) -> None:
        """A newer coordinator took over: freezes of the old one end now (the watchdog puts
        their ranks back as soon as no call of theirs is in flight)."""
        with self._lock:
            for fr in self._freezes.values():
                fr.expired = True

    @contextlib.contextmanager
    def _driving(self, freeze_id: str, must_exist: bool = True) -> Iterator[Any]:
        """A coordinator call on a freeze: the lease does not run out while it is in flight."""
        with self._lock:
            fr = self._freezes.get(freeze_id)
            if fr is not None:
                fr.in_flight += 1
                fr.touched = time.monotonic()
        if fr is None and must_exist:
            fr = self._freeze(freeze_id)  # raises the typed error
        try:
            yield fr
        finally:
            if fr is not None:
                with self._lock:
                    fr.in_flight -= 1
                    fr.touched = time.monotonic()

    def _maintain(self) -> None:
        """The agent's one background loop: freeze leases (every half second) and
        housekeeping (stray children, retention) every `housekeeping_s`."""
        lease = self.settings.freeze_lease_s
        tick = min(0.5, lease / 4) if lease > 0 else 0.5
        next_housekeeping = time.monotonic() + self.settings.housekeeping_s
        while not self._closed.wait(tick):
            if lease > 0:
                self._check_leases(lease)
            if time.monotonic() >= next_housekeeping:
                try:
                    self.housekeep()
                except Exception:  # noqa: BLE001 - the loop must keep running
                    log.exception("housekeeping failed")
                next_housekeeping = time.monotonic() + self.settings.housekeeping_s

    def _check_leases(self, lease: float) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [
                f for f in self._freezes.values()
                if f.in_flight == 0 and (f.expired or now - f.touched > lease)
            ]  # fmt: skip
        for fr in expired:
            try:
                self._abandon(fr)
            except Exception:  # noqa: BLE001 - the watchdog must keep running
                log.exception("recovering abandoned freeze %s failed", fr.freeze_id)
                with self._lock:
                    fr = self._freezes.pop(fr.freeze_id, fr)  # once: never retried
                if fr.writer is not None:
                    fr.writer.release()

    def housekeep(self) -> None:
        """Reap stray children; forget old finished jobs (and their logs); stop stores and
        drop fetched thaws a dead coordinator left; keep CRIU's logs within bounds."""
        children.reap_strays()
        r = self.settings.retention
        now, wall = time.monotonic(), time.time()
        with self._lock:
            finished = {
                j: job.ended or wall for j, job in self._jobs.items() if job.state.terminal
            }
            forget_jobs = retention.jobs_to_forget(
                finished, wall, r.finished_jobs, r.finished_job_age_s
            )
            for j in forget_jobs:
                self._jobs.pop(j, None)
            stale_stores = retention.expired(self._store_opened, now, r.unclaimed_store_s)
            stores = [self._stores.pop(j) for j in stale_stores if j in self._stores]
            for j in stale_stores:
                self._store_opened.pop(j, None)
            stale_fetches = retention.expired(self._fetched, now, r.stale_fetch_s)
            live_ops = {fr.freeze_id for fr in self._freezes.values()} | set(self._fetched)
            live_jobs = set(self._jobs) | set(self._launching)
        for j in forget_jobs:
            if j not in live_jobs:
                shutil.rmtree(self.paths.job_dir(j), ignore_errors=True)
        for st in stores:
            log.warning("stopping a rendezvous store no launch or thaw claimed")
            st.stop()
        for op in stale_fetches:
            log.warning("dropping thaw %s: fetched but never restored nor discarded", op)
            self.discard_fetch(op)
        self._prune_criu_logs(r.criu_log_dirs, live_ops)

    def _prune_criu_logs(self, keep: int, live_ops: set[str]) -> None:
        root = self.paths.criu_logs("x").parent
        try:
            dirs = {d.name: d.stat().st_mtime for d in root.iterdir() if d.is_dir()}
        except OSError:
            return
        for name in retention.dirs_to_prune(dirs, keep, live_ops):
            shutil.rmtree(root / name, ignore_errors=True)

    def resources(self) -> Resources:
        """What this agent process holds now (what must not grow with jobs handled)."""
        return resources()

    def _abandon(self, fr: _Freeze) -> None:
        """The coordinator stopped driving this freeze: put the ranks back as they were.
        Chunks already uploaded stay (a manifest may have been written after all): without a
        manifest they are orphans for `snapshotter gc`."""
        log.warning(
            "freeze %s of job %s: no word from the coordinator for %.0fs; %s",
            fr.freeze_id, fr.job_id, self.settings.freeze_lease_s,
            "resuming the ranks" if fr.suspended and not fr.resumed else "releasing the ranks",
        )  # fmt: skip
        job = self.job(fr.job_id)
        if job.state.terminal or len(job.alive_ranks()) != len(job.ranks):
            job.stop(NodeJobState.FAILED)  # nothing left to put back
            self._end_freeze(job, fr.freeze_id)
            return
        if fr.suspended and not fr.resumed:
            self._gpu_release(fr.freeze_id)
            # Every node's agent recovers the same way, so all ranks meet under one epoch.
            self._resume_ranks(job, job.store_address, f"{fr.freeze_id}-recovered", 300.0)
            self._end_freeze(job, fr.freeze_id)
        elif not fr.suspended:
            self.abort(fr.job_id, fr.freeze_id)
        else:
            self._end_freeze(job, fr.freeze_id)

    def _freeze(self, freeze_id: str) -> _Freeze:
        with self._lock:
            fr = self._freezes.get(freeze_id)
        if fr is None:
            raise errors.FreezeFailed(
                f"unknown freeze {freeze_id} on node {self.settings.name}",
                "the agent restarted during the freeze; retry it",
            )
        return fr

    def _end_freeze(self, job: NodeJob, freeze_id: str) -> None:
        """Release everything a freeze holds, whichever way it ended. Chunks it uploaded stay:
        committed, discarded (DiscardUpload) or left for gc, the coordinator decides."""
        with self._lock:
            fr = self._freezes.pop(freeze_id, None)
        if fr is not None:
            if fr.writer is not None:
                fr.writer.release()
            shutil.rmtree(fr.work, ignore_errors=True)
        if job.op_lock.locked():
            job.op_lock.release()

    # ----------------------------------------------------------------- thaw
    def fetch(self, snapshot_id: str, streams: list[str]) -> Iterator[Msg]:
        """Download and verify every chunk of the given streams, then unpack them into a
        staging directory. Phase one of a thaw: no process starts before every node fetched."""
        op = f"thaw-{uuid.uuid4().hex[:12]}"
        work = self.paths.work_dir(op)
        reader = SnapshotReader(self.store, snapshot_id)
        t0 = time.monotonic()
        try:
            yield {"event": "phase", "phase": "fetch", "node": self.settings.name}
            # Stage only the verified compressed chunks; ranks' streams unpack in parallel.
            reader.verify_and_fetch(work / "staging", streams=streams, decompress=False)
            reader.extract_directories({s: work / s for s in streams})
            shutil.rmtree(work / "staging", ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        with self._lock:
            self._fetched[op] = time.monotonic()  # expires unless restored or discarded
        yield {
            "event": "fetched",
            "node": self.settings.name,
            "op": op,
            "fetch_s": time.monotonic() - t0,
        }

    def discard_fetch(self, op: str) -> Msg:
        if op.startswith("thaw-") and "/" not in op:
            with self._lock:
                self._fetched.pop(op, None)
            shutil.rmtree(self.paths.work_dir(op), ignore_errors=True)
        return {}

    def restore(
        self,
        op: str,
        spec: JobSpec,
        ranks: list[Msg],
        node_rank: int,
        timeout: float,
        store_at: StoreAddress | None = None,
        epoch: str | None = None,
    ) -> Msg:
        """Restore this node's ranks from a fetched snapshot, in parallel, then resume them
        with this node's store address and network settings."""
        with self._lock:
            old = self._jobs.get(spec.job_id)
            if old is not None and not old.state.terminal:
                raise errors.InvalidArgument(
                    f"job {spec.job_id} is already running", "thaw with another --job-id"
                )
        work = self.paths.work_dir(op)
        if not work.is_dir():
            raise errors.ThawFailed(
                f"nothing fetched for thaw {op} on node {self.settings.name}",
                "retry the thaw; the fetch phase must complete first",
            )
        job: NodeJob | None = None
        store: StoreServer | None = None
        watched = False
        try:
            # Refuse before any process starts when this node cannot take the GPU state.
            recorded = records_of(ranks)
            gpu = self._gpu() if recorded else None
            if recorded and gpu is None:
                raise errors.GpuRemapRefused(
                    f"the snapshot holds GPU state of rank(s) {sorted(recorded)}, and node "
                    f"{self.settings.name} has no usable NVIDIA driver",
                    "thaw onto a node with NVIDIA GPUs of the snapshot's type (r550+ driver)",
                )
            mapping = gpu.plan(recorded) if gpu is not None else {}
            store, remote = self._store_for(spec, store_at)
            job = NodeJob(spec=spec, node_rank=node_rank, store=store, remote_store=remote)
            logs = self.paths.criu_logs(op)

            def one(rec: Msg) -> RankRuntime:
                init_cwd = Path(rec["init_cwd"])
                made = not init_cwd.is_dir()
                init_cwd.mkdir(parents=True, exist_ok=True)
                sb = criu.restore(
                    work / rec["stream"],
                    {k: int(v) for k, v in rec["inodes"].items()},
                    log_dir=logs / rec["stream"],
                    netns=self.settings.netns,
                )
                p = RankPlacement(
                    rank=int(rec["rank"]),
                    local_rank=int(rec["local_rank"]),
                    node_rank=node_rank,
                    world_size=spec.world_size,
                    local_world_size=spec.nproc_per_node,
                    nnodes=spec.nnodes,
                )
                return self._new_rank(p, sb, spec.job_id, rec["init_cwd"], made)

            t1 = time.monotonic()
            with self._pool(len(ranks)) as pool:
                futs = [pool.submit(one, rec) for rec in ranks]
                first: BaseException | None = None
                for f in futs:
                    try:
                        job.ranks.append(f.result())
                    except BaseException as e:  # noqa: BLE001
                        first = first or e
                if first is not None:
                    raise first
            restore_s = time.monotonic() - t1
            self._register(job)
            job.watch()
            watched = True
            gpu_out: Msg = {}
            if gpu is not None:
                t_gpu = time.monotonic()
                pids = {r.rank: r.sandbox.pid for r in job.ranks}
                thawed = gpu.thaw(pids, recorded, mapping)
                gpu_out = {str(k): v for k, v in thawed.items()}
                restore_s += time.monotonic() - t_gpu
            t2 = time.monotonic()
            # Every node's ranks must rebuild under one epoch (the coordinator's thaw id).
            self._resume_ranks(job, job.store_address, epoch or op, timeout)
            res: Msg = {
                "node": self.settings.name,
                "restore_s": restore_s,
                "resume_s": time.monotonic() - t2,
                "job": job.describe(),
            }
            if gpu_out:
                res["gpu"] = gpu_out
            return res
        except BaseException as e:
            if job is not None and watched:
                job.stop(NodeJobState.FAILED)  # its watchers release what the ranks hold
            elif job is not None:
                self._undo_launch(job, e)
            if store is not None:
                store.stop()
            raise
        finally:
            with self._lock:
                self._fetched.pop(op, None)
            shutil.rmtree(work, ignore_errors=True)

    def _resume_ranks(self, job: NodeJob, store: StoreAddress, epoch: str, timeout: float) -> None:
        """Every rank rebuilds its communicators against `store` under a fresh `epoch`, with
        this node's network settings."""
        msg = {
            "op": "resume",
            "freeze": epoch,
            "store": {"host": store.host, "port": store.port},
            "epoch": epoch,
            "env": resume_env(store, self.node_env),
        }
        self._each(job, lambda r: r.channel.request(dict(msg), "resumed", timeout))

    # ----------------------------------------------------------------- queries
    def status(self, job_id: str) -> Msg:
        return self.job(job_id).describe()

    def jobs(self) -> Msg:
        """Every job this node holds, with its spec: what a restarted coordinator re-learns."""
        with self._lock:
            jobs = list(self._jobs.values())
        return {"jobs": [{**j.describe(), "spec": j.spec.to_dict()} for j in jobs]}

    def wait(self, job_id: str, timeout: float) -> Msg:
        job = self.job(job_id)
        job.wait(timeout)
        return job.describe()

    def cancel(self, job_id: str) -> Msg:
        with self._lock:
            launching = self._launching.get(job_id)
        if launching is not None:
            # The launch ends what it started and fails; its caller reports that.
            launching.set()
            return {"job_id": job_id, "state": NodeJobState.CANCELLED.value, "ranks": []}
        job = self.job(job_id)
        if not job.state.terminal:
            job.stop(NodeJobState.CANCELLED)
        return job.describe()

    def logs(self, job_id: str, rank: int | None, offset: int, follow: bool) -> Iterator[Msg]:
        job = self.job(job_id)
        ranks = [r.rank for r in job.ranks] if rank is None else [rank]
        if rank is not None and rank not in {r.rank for r in job.ranks}:
            raise errors.InvalidArgument(
                f"job {job_id} has no rank {rank} on node {self.settings.name}",
                f"ranks here: {sorted(r.rank for r in job.ranks)}",
            )
        if len(ranks) == 1:
            path = self.paths.log_file(job_id, ranks[0])
            for off, data in follow_file(path, offset, follow, lambda: job.state.terminal):
                yield {"rank": ranks[0], "offset": off, "data": data.decode(errors="replace")}
            return
        # Several ranks: whole files, rank by rank (following interleaves poorly).
        for rk in ranks:
            path = self.paths.log_file(job_id, rk)
            for off, data in follow_file(path, 0, False, lambda: True):
                yield {"rank": rk, "offset": off, "data": data.decode(errors="replace")}

    def shutdown(self) -> None:
        self._closed.set()
        if self._maintainer is not threading.current_thread():
            self._maintainer.join(timeout=10)
        with self._lock:
            jobs = list(self._jobs.values())
            stores = list(self._stores.values())
            self._stores.clear()
        for st in stores:
            st.stop()
        for j in jobs:
            if not j.state.terminal:
                j.stop(NodeJobState.CANCELLED)

    def running_jobs(self) -> list[str]:
        with self._lock:
            return [j.spec.job_id for j in self._jobs.values() if not j.state.terminal]
