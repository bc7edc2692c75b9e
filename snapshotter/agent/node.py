"""The node agent: owns the rank processes of its node and checkpoints them.

A thin facade over its parts, each in its own module:

    launch.py     start a job's ranks (all or nothing)
    freeze.py     the freeze phases and their leases (FreezePhase)
    thaw.py       fetch and restore
    runtime.py    a job's ranks (NodeJob), the per-rank fan-out, the job table
    progress.py   sampling the ranks' training progress (steps, collective counts)
    sandboxes.py  sandbox -> RankRuntime, and the per-sandbox state on disk
    rdzv.py       rendezvous servers hosted for jobs with this node as node 0
    service.py    the gRPC surface (snapshotter.v1.Agent)

Here: queries, the one background loop (leases, reaping strays, retention) and shutdown. The
agent never decides whether a freeze goes on; it reports, and the coordinator decides.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from snapshotter import __version__, errors
from snapshotter.agent import audit, keeping, probe, settle
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.checkpoints import CheckpointSpool
from snapshotter.agent.freeze import Freezes
from snapshotter.agent.launch import Launcher
from snapshotter.agent.links import Links
from snapshotter.agent.local_copy import LocalCopies
from snapshotter.agent.logs import follow_file
from snapshotter.agent.orphans import reap_orphans
from snapshotter.agent.peers import Conn, established
from snapshotter.agent.progress import TIMEOUT_S as PROGRESS_TIMEOUT_S
from snapshotter.agent.progress import sample as sample_progress
from snapshotter.agent.rdzv import RdzvHost
from snapshotter.agent.retention import Retention, dirs_to_prune
from snapshotter.agent.runtime import JobTable, NodeJob, NodeJobState
from snapshotter.agent.sandboxes import Sandboxes
from snapshotter.agent.thaw import Thaws
from snapshotter.agent.weights import WeightsHub
from snapshotter.config import Paths, local_copy_bytes, rdzv_spares
from snapshotter.gpu import auto_health, auto_stage
from snapshotter.gpu.health import GpuFault, GpuHealth, fault_proto
from snapshotter.gpu.stage import GpuStage
from snapshotter.launch.env import RdzvAddress
from snapshotter.procutil import resources
from snapshotter.rpc.tls import TlsFiles
from snapshotter.sandbox import children
from snapshotter.sandbox.spawn import become_subreaper
from snapshotter.storage.api import ObjectStore
from snapshotter.v1 import agent_pb2, common_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeSettings:
    name: str
    paths: Paths
    # Address ranks of this node use to reach the job's rendezvous server (the node's own).
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
    # Builds this node's GPU fault watcher (None: none). Unset: NVML when there is one.
    gpu_health: Callable[[], GpuHealth | None] | None = None
    # Seconds a freeze may go without any call or keep-alive from the coordinator before the
    # agent gives up on it and resumes (or unparks) its ranks; 0 disables the lease.
    freeze_lease_s: float = 60.0
    # What finished jobs, logs and abandoned operations the agent keeps (agent/retention.py).
    retention: Retention = field(default_factory=Retention)
    # How often the agent reaps stray children and applies the retention bounds.
    housekeeping_s: float = 10.0
    # Which interpreters and working directories jobs may use (agent/allow.py).
    policy: ExecPolicy = field(default_factory=ExecPolicy.default)
    # Disk the newest snapshot of each job may keep here for thaws without a fetch
    # (agent/local_copy.py); None: SNAPSHOTTER_LOCAL_COPY_BYTES or a quarter of the disk.
    local_copy_bytes: int | None = None
    # This node's certificate, to read a migrating rank's images from another node's agent
    # (None: plaintext, agents on loopback in tests).
    peer_tls: TlsFiles | None = None
    # Its data links, in plane order (agent/links.py); none: one plane, the listen address's.
    links: tuple[str, ...] = ()
    # The store URL this agent uploads to: its ranks' application checkpoints to that store
    # go through the agent (agent/checkpoints.py); "" leaves them to the ranks.
    store_url: str = ""


class NodeAgent:
    def __init__(self, settings: NodeSettings, store: ObjectStore) -> None:
        self.settings = settings
        self.paths = settings.paths
        self.store = store
        self.incarnation = uuid.uuid4().hex[:12]
        self._closed = threading.Event()
        self._gpu_lock = threading.Lock()
        self._gpu_stage: GpuStage | None = None
        self._gpu_checked = False
        become_subreaper()
        self.keeper = keeping.from_env()
        held = self.keeper.held() if self.keeper is not None else []
        # Whatever the keeper holds is re-adopted below; the rest has lost its agent for good.
        reap_orphans(self.paths.home / "sandboxes", {int(e["pid"]) for e in held})
        # No operation outlives the agent that ran it: what a previous one staged is garbage.
        shutil.rmtree(self.paths.home / "work", ignore_errors=True)

        name = settings.name
        self.links = Links(settings.links, dict(settings.network_env))
        self.links.clear_bridges()  # a predecessor that died mid-reroute may have left some
        self.jobs = JobTable(name)
        self.checkpoints = CheckpointSpool(self.paths.home / "ckpt-spool", store,
                                           settings.store_url, self.jobs, self.incarnation)
        shm = Path("/dev/shm")
        self.weights = WeightsHub(
            (shm if shm.is_dir() else self.paths.home) / f"snapshotter-weights-{self.incarnation}",
            name, settings.peer_tls,
        )
        self.checkpoints.weights = self.weights
        links_env, ckpt_env = self.links.env, self.checkpoints.env

        def env(plane: int = 0) -> dict[str, str]:
            return {**links_env(plane), **ckpt_env()}

        self.sandboxes = Sandboxes(self.paths, self.keeper)
        self.rdzv = RdzvHost(settings.host, rdzv_spares())
        self.launcher = Launcher(
            name, self.paths, self.jobs, self.sandboxes, self.rdzv, settings.policy, env,
            settings.netns, settings.private_tmp,
        )  # fmt: skip
        cap = settings.local_copy_bytes
        self.copies = LocalCopies(
            self.paths.copies_dir, local_copy_bytes(self.paths.home) if cap is None else cap
        )
        self.freezes = Freezes(
            name, self.paths, store, self.jobs, self._gpu, env, settings.dump_parallelism,
            settings.freeze_lease_s, self.copies,
        )  # fmt: skip
        self.thaws = Thaws(
            name, self.paths, store, self.jobs, self.sandboxes, self.rdzv, self.freezes,
            self._gpu, settings.netns, settings.dump_parallelism, self.copies, settings.peer_tls,
        )  # fmt: skip
        self.readopted = self.sandboxes.readopt(self.jobs, settings.host) if held else []
        for job_id in self.readopted:
            # Off the start-up path: asking the ranks takes a moment, a resume longer.
            threading.Thread(target=self._settle, args=(job_id,), daemon=True,
                             name=f"settle-{job_id}").start()  # fmt: skip
        self.gpu_health = (settings.gpu_health or auto_health)()
        self._maintainer = threading.Thread(target=self._maintain, daemon=True, name="maintain")
        self._maintainer.start()
        self.checkpoints.start()

    def _settle(self, job_id: str) -> None:
        """A re-adopted job that the previous agent left mid-freeze runs again (settle.py)."""
        try:
            job = self.jobs.get(job_id)
        except Exception:  # noqa: BLE001 - gone already (ended, or cancelled)
            return
        settle.settle(
            job, lambda j, epoch: self.freezes.resume_ranks(j, j.rdzv_address, epoch, 120.0)
        )

    def _gpu(self) -> GpuStage | None:
        """This node's GPU stage, found once (no driver: None, logged once by auto_stage)."""
        with self._gpu_lock:
            if not self._gpu_checked:
                self._gpu_stage = (self.settings.gpu or auto_stage)()
                self._gpu_checked = True
            return self._gpu_stage

    # ---- queries -----------------------------------------------------------------------------

    def info(self) -> common_pb2.AgentInfo:
        return common_pb2.AgentInfo(
            node=self.settings.name,
            version=__version__,
            pid=os.getpid(),
            host=self.settings.host,
            incarnation=self.incarnation,
            resources=common_pb2.Resources(**resources().to_dict()),
            running_jobs=self.jobs.running_ids(),
            gpu_faults=[fault_proto(f) for f in self.gpu_faults(fatal_only=False)],
            cpus=len(os.sched_getaffinity(0)),
            gpus=gpu_count(),
        )

    def gpu_faults(self, since: float = 0.0, fatal_only: bool = True) -> list[GpuFault]:
        """What NVML reported on this node since `since` (epoch seconds)."""
        return self.gpu_health.faults(since, fatal_only) if self.gpu_health else []

    def status(self, job_id: str) -> agent_pb2.NodeJob:
        """A job's state here, with the fatal GPU faults since it started on this node (the
        coordinator's supervisor moves it off a failing GPU)."""
        job = self.jobs.get(job_id)
        m = job.to_proto()
        m.node = self.settings.name
        m.gpu_faults.extend(fault_proto(f) for f in self.gpu_faults(job.started))
        return m

    def wait(self, job_id: str, timeout: float) -> NodeJob:
        job = self.jobs.get(job_id)
        job.wait(timeout)
        return job

    def progress(self, job_id: str, timeout: float = PROGRESS_TIMEOUT_S, peers: bool = False,
                 conns: list[Conn] | None = None) -> common_pb2.JobProgress:  # fmt: skip
        """Each of the job's ranks here: optimizer steps and collectives issued per group, or
        that it did not answer within `timeout` and its process state (agent/progress.py).
        A job a freeze or thaw holds is `busy`, and no rank is asked.

        Raises:
            JobNotFound: no such job here.
            InvalidArgument: `timeout` is not in (0, PROGRESS_TIMEOUT_S].
        """
        reply = sample_progress(self.jobs.get(job_id), timeout, peers, conns)
        reply.node = self.settings.name
        return reply

    def sample_running(self) -> list[common_pb2.JobProgress]:
        """Every running job's progress here, for the metrics (a job that ended meanwhile is
        left out; one a freeze or thaw holds is `busy`, each of its ranks unanswered)."""
        out = []
        running = self.jobs.running_ids()
        conns = established() if running else []  # one `ss` a scrape, not one a job
        for job_id in running:
            try:
                p = self.progress(job_id, timeout=0.5, peers=True, conns=conns)
            except errors.SnapshotterError:
                continue
            out.append(p)
        return out

    def cancel(self, job_id: str) -> NodeJob | None:
        """End a job's ranks here; None when it was still launching (the launch then ends
        what it started and fails)."""
        if self.jobs.cancel_launch(job_id):
            return None
        job = self.jobs.get(job_id)
        if not job.state.terminal:
            job.stop(NodeJobState.CANCELLED)
        return job

    def set_policy(self, job_id: str, policy: common_pb2.Policy) -> NodeJob:
        """The job's policy as `policy set|clear` changed it: a restarted coordinator re-learns
        it from here, a restarted agent from its keeper."""
        job = self.jobs.get(job_id)
        job.spec = job.spec.with_policy(policy)
        if self.keeper is not None and job.ranks:
            try:
                self.keeper.respec(job_id, job.spec.to_dict())
            except errors.SnapshotterError as e:  # an older keeper: the next agent has the old
                log.warning("job %s: the keeper keeps its launch policy (%s)", job_id, e)
        return job

    def move_rdzv(self, job_id: str, addr: RdzvAddress) -> None:
        """The job's rendezvous server moved (its node 0 migrated): this node's ranks resume
        against `addr` from now on, also after this agent restarts."""
        job = self.jobs.get(job_id)
        if job.rdzv is not None:
            raise errors.InvalidArgument(
                f"node {self.settings.name} hosts job {job_id}'s rendezvous server itself",
                "only the other nodes are told where it moved",
            )
        job.remote_rdzv = addr
        if self.keeper is not None and job.ranks:
            try:
                self.keeper.rerdzv(job_id, addr.host, addr.port)
            except errors.SnapshotterError as e:  # an older keeper: the next agent is told anew
                log.warning("job %s: the keeper keeps the old rendezvous address (%s)", job_id, e)

    def logs(
        self, job_id: str, rank: int | None, offset: int, follow: bool
    ) -> Iterator[common_pb2.LogChunk]:
        job = self.jobs.get(job_id)
        if rank is not None and rank not in {r.rank for r in job.ranks}:
            raise errors.InvalidArgument(
                f"job {job_id} has no rank {rank} on node {self.settings.name}",
                f"ranks here: {sorted(r.rank for r in job.ranks)}",
            )
        if rank is not None:
            path = self.paths.log_file(job_id, rank)
            for off, data in follow_file(path, offset, follow, lambda: job.state.terminal):
                yield common_pb2.LogChunk(rank=rank, offset=off, data=data)
            return
        # Every rank: whole files, rank by rank (following interleaves poorly).
        for rk in sorted(r.rank for r in job.ranks):
            for off, data in follow_file(self.paths.log_file(job_id, rk), 0, False, lambda: True):
                yield common_pb2.LogChunk(rank=rk, offset=off, data=data)

    # ---- the background loop -----------------------------------------------------------------

    def _maintain(self) -> None:
        """Freeze leases every half second; housekeeping every `housekeeping_s`."""
        lease = self.settings.freeze_lease_s
        tick = min(0.5, lease / 4) if lease > 0 else 0.5
        next_housekeeping = time.monotonic() + self.settings.housekeeping_s
        while not self._closed.wait(tick):
            if lease > 0:
                self.freezes.check_leases()
            if time.monotonic() >= next_housekeeping:
                try:
                    self.housekeep()
                except Exception:  # noqa: BLE001 - the loop must keep running
                    log.exception("housekeeping failed")
                next_housekeeping = time.monotonic() + self.settings.housekeeping_s

    def housekeep(self) -> None:
        """Reap stray children; forget old finished jobs (their logs and local copies); drop
        the local copies of jobs that succeeded (a failed, cancelled or frozen one may be
        thawed here next); stop rendezvous servers and drop fetched thaws a dead coordinator
        left; keep CRIU's logs bounded."""
        children.reap_strays()
        self.checkpoints.prune()
        self.weights.prune(set(self.jobs.running_ids()))
        r = self.settings.retention
        for job_id in self.jobs.forget_finished(r.finished_jobs, r.finished_job_age_s):
            shutil.rmtree(self.paths.job_dir(job_id), ignore_errors=True)
            self.copies.drop_job(job_id)
        for j in self.jobs.all():
            if j.state is NodeJobState.SUCCEEDED:
                self.copies.drop_job(j.spec.job_id)
        for job_id in self.rdzv.expire(r.unclaimed_store_s):
            log.warning("stopped the rendezvous server opened for job %s: never claimed", job_id)
        self.rdzv.expire_spares(set(self.jobs.running_ids()), r.unclaimed_store_s)
        for op in self.thaws.expire(r.stale_fetch_s):
            log.warning("dropped thaw %s: fetched but never restored nor discarded", op)
        root = self.paths.criu_logs("x").parent
        try:
            dirs = {d.name: d.stat().st_mtime for d in root.iterdir() if d.is_dir()}
        except OSError:
            return
        live = self.freezes.live_ids() | self.thaws.live_ops()
        for name in dirs_to_prune(dirs, r.criu_log_dirs, live):
            shutil.rmtree(root / name, ignore_errors=True)

    # ---- cluster audit (agent/audit.py, agent/probe.py) ----------------------------------

    def audit_node(self, req: agent_pb2.AuditNodeRequest) -> agent_pb2.AuditNodeReply:
        nbytes = min(max(req.storage_bytes, 0) or (8 << 20), 256 << 20)
        return agent_pb2.AuditNodeReply(checks=audit.node_checks(
            self.store, self.settings.name, self.paths.home, nbytes, self.gpu_health))

    def plane_ip(self, plane: int) -> str:
        """This node's address on data-link `plane` (without links: its listen address).

        Raises: InvalidArgument for a plane it lacks."""
        states = self.links.states()
        if not states:
            if plane != 0:
                raise errors.InvalidArgument(f"node {self.settings.name} has one plane only",
                                             "probe plane 0")  # fmt: skip
            return self.settings.host
        if not 0 <= plane < len(states) or not states[plane].ip:
            raise errors.InvalidArgument(
                f"node {self.settings.name} has no address on data-link plane {plane}",
                "configure it with `snapshotter agent --link` (an interface with an IPv4)",
            )
        return states[plane].ip

    def open_probe(self, req: agent_pb2.OpenProbeRequest) -> agent_pb2.ProbeEndpoint:
        ip = self.plane_ip(req.plane)
        port = probe.open_listener(ip, req.token, req.peer, self.settings.peer_tls)
        return agent_pb2.ProbeEndpoint(address=ip, port=port)

    def probe_link(self, req: agent_pb2.ProbeLinkRequest) -> agent_pb2.LinkMeasurement:
        """Measure the link to a peer's listener; a failed probe is a measurement too."""
        try:
            m = probe.probe(req.address, req.port, req.token, req.peer, req.bytes or (32 << 20),
                            self.plane_ip(req.plane), self.settings.peer_tls)  # fmt: skip
        except OSError as e:  # ConnectionError and ssl.SSLError among them
            return agent_pb2.LinkMeasurement(error=f"{type(e).__name__}: {e}")
        return agent_pb2.LinkMeasurement(rtt_ms=m.rtt_ms, mbps=m.mbps, retrans=m.retrans)

    def shutdown(self, keep_ranks: bool = False) -> None:
        """Stop serving. Running jobs are cancelled, unless `keep_ranks` (a reload under a
        keeper: the ranks go on and the next agent re-adopts them; their rendezvous servers
        stop now so that it can listen on the same ports)."""
        self._closed.set()
        if self._maintainer is not threading.current_thread():
            self._maintainer.join(timeout=10)
        self.checkpoints.close()
        self.weights.close()
        if self.gpu_health is not None:
            self.gpu_health.stop()
        self.rdzv.stop_all()
        for j in self.jobs.all():
            if j.state.terminal:
                continue
            if not keep_ranks:
                j.stop(NodeJobState.CANCELLED)
            elif j.rdzv is not None:
                j.rdzv.stop()


def gpu_count(dev: str = "/dev") -> int:
    """The node's NVIDIA GPUs, as their device files (no driver library needed to count)."""
    try:
        return sum(1 for d in os.listdir(dev) if d.startswith("nvidia") and d[6:].isdigit())
    except OSError:
        return 0
