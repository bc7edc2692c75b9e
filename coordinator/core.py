"""The coordinator: owns jobs, places them on node agents and runs their freezes and thaws.

It keeps which job runs on which agents and which operation holds a job; the agents own the
processes, and the object store's manifests are the truth about snapshots (snapshots.py).
Nothing here outlives the process: after a restart, agents re-register (their heartbeat) and
report their jobs, so a new coordinator picks up where the old one was. Decisions are pure
functions in decisions.py; the phased operations are freeze.py and thaw.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter import __version__, errors, metrics
from snapshotter.agent.retention import jobs_to_forget
from snapshotter.coordinator import decisions, detect, quotas, snapshots
from snapshotter.coordinator import policy as policies
from snapshotter.coordinator.agents import AgentHandle, call_all, open_rdzv_req
from snapshotter.coordinator.decisions import (
    JobPhase,
    exit_code,
    job_phase,
    next_plane,
    place,
    supervised_phase,
    thaw_job_id,
)
from snapshotter.coordinator.freeze import FreezeOperation, FreezeSettings
from snapshotter.coordinator.journal import Journal
from snapshotter.coordinator.life import JobLife
from snapshotter.coordinator.quotas import TenantLimits
from snapshotter.coordinator.thaw import ThawOperation
from snapshotter.coordinator.webhooks import WebhookConfig, Webhooks
from snapshotter.coordinator.weights import WeightsBoard
from snapshotter.launch.spec import JobSpec, new_job_id, nproc_for, validate_job_id
from snapshotter.procutil import resources
from snapshotter.rpc import convert, relay
from snapshotter.rpc.auth import Role
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import caller, caller_active
from snapshotter.storage import signing
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.datakeys import DEFAULT_TENANT, DataKeys
from snapshotter.storage.sealing import Seal
from snapshotter.storage.transfer import SnapshotReader
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
pb = coordinator_pb2
WEEK_S = 7 * 24 * 3600.0
# Node states of a job that ended: it ended there, or that node's agent forgot it.
_GONE_OR_ENDED = frozenset({"UNREACHABLE", "SUCCEEDED", "FAILED", "CANCELLED", "FROZEN"})


@dataclass
class JobRecord:
    spec: JobSpec
    nodes: list[str]
    busy: str | None = None
    snapshots: list[str] = field(default_factory=list)
    thawed_from: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Wall time the job was first seen finished (None while it is not), and how it ended: a
    # restarted agent no longer knows a finished job, which must not make it look running.
    ended: float | None = None
    final: JobPhase | None = None
    life: JobLife = field(default_factory=JobLife)
    # The data-link plane its communicators use (coordinator/reroute.py).
    plane: int = 0
    # Ranks that run on another agent than their node rank's (`migrate --rank`): rank -> node.
    moved: dict[int, str] = field(default_factory=dict)

    @property
    def recovers(self) -> bool:
        return self.spec.recovery.mode == "auto"

    @property
    def agents(self) -> list[str]:
        """Every node holding ranks of the job: its nodes in node-rank order, then those
        that took single ranks."""
        return [*self.nodes, *sorted({n for n in self.moved.values() if n not in self.nodes})]

    def holder(self, rank: int) -> str:
        """The node rank `rank` runs on."""
        return self.moved.get(rank) or self.nodes[rank // self.spec.nproc_per_node]

    def settle_moved(self) -> None:
        """Forget moves that put a rank back on its node rank's node."""
        n = self.spec.nproc_per_node
        self.moved = {r: a for r, a in self.moved.items() if self.nodes[r // n] != a}


# How the coordinator reaches an agent that registered with this address and name.
AgentTarget = Callable[[str, str], Target]


class Coordinator:
    def __init__(
        self,
        store: ObjectStore,
        store_url: str,
        agent_target: AgentTarget,
        token: tuple[int, str] | None = None,
        agent_ttl: float = 15.0,
        keep_finished_jobs: int = 100,
        keys_dir: Path | None = None,
        encrypt: bool = True,
        limits: TenantLimits | None = None,
        webhooks: Webhooks | None = None,
        max_beats_per_s: float = decisions.MAX_BEATS_PER_S,
    ) -> None:
        """`keys_dir`: where its snapshot signing key, trusted keys and tenants' data keys
        live (signing.py, datakeys.py); None: fresh keys in memory (tests), trusting only
        itself. `encrypt`: seal every snapshot's chunks under its tenant's data key.
        `limits`: per-tenant quotas on snapshots (quotas.py; None: none). `webhooks`: where
        jobs' events go to their tenants (webhooks.py; None: nowhere). `max_beats_per_s`:
        the agents are asked to beat less often when more would arrive (0: no bound)."""
        self.store = store
        self.signer, self.keyring = signing.load(keys_dir)
        self.data_keys = DataKeys(keys_dir)
        self.encrypt = encrypt
        self.limits = limits or TenantLimits(None)
        # In memory when not given (tests, embedded use): SetTenant still keeps endpoints.
        self.webhooks: Webhooks | None = webhooks or Webhooks(WebhookConfig(None))
        self.store_url = store_url
        self.agent_target = agent_target
        self.token = token
        self.agent_ttl = agent_ttl
        self.max_beats_per_s = max_beats_per_s
        self.keep_finished_jobs = keep_finished_jobs
        self._agents: dict[str, AgentHandle] = {}
        # Signs the phase calls that relay agents deliver for it (rpc/relay.py).
        self.relay = relay.Signer()
        self._jobs: dict[str, JobRecord] = {}
        # Snapshots this coordinator's freezes are writing now: never garbage to gc.
        self.writing: set[str] = set()
        # Snapshots a thaw reads now: never expired by a retention policy meanwhile.
        self.reading: set[str] = set()
        # Nodes being drained: nothing new is placed there; those whose agent drained itself,
        # with that agent's incarnation (a new agent there ends the mark).
        self.draining: set[str] = set()
        self.self_drained: dict[str, str] = {}
        # Data links an operator drained, by node (`snapshotter link drain`).
        self.drained_links: dict[str, set[str]] = {}
        # Set when a node reports a data link's state changed: the supervisor looks at once.
        self.links_changed = threading.Event()
        # What the cluster's failure rate is estimated from (`--snapshot-every auto`).
        self.first_seen: dict[str, float] = {}
        self.failures_seen = 0
        self.prior_node_mtbf_s = float(
            os.environ.get("SNAPSHOTTER_PRIOR_NODE_MTBF_S", policies.DEFAULT_PRIOR_NODE_MTBF_S)
        )
        # Each job's events and recoveries, kept in the store for the next coordinator.
        self.journal = Journal(store)
        # Weight push's directory: newest version per channel, who pulls from whom.
        self.weights = WeightsBoard(self)
        self._lock = threading.Lock()

    # ---- agents ------------------------------------------------------------------------------

    def register_agent(self, req: pb.RegisterAgentRequest) -> pb.RegisterAgentReply:
        """An agent announces itself (at start, then as a heartbeat). A new, moved or restarted
        agent gets a new handle (a fresh connection) and is asked for its jobs, so a restarted
        coordinator re-learns what runs where."""
        who = node_caller(req.name, "register as", "start the agent with --name matching its "
                           "certificate")  # fmt: skip
        metrics.HEARTBEATS.labels(req.name).inc()
        if who is not None and who.role not in (Role.NODE, Role.ROOT):
            log.warning("agent %s registered by %s", req.name, who)
        seen = time.monotonic() if req.heartbeat else None
        replaced: AgentHandle | None = None
        with self._lock:
            old = self._agents.get(req.name)
            fresh = old is None or old.address != req.address or old.incarnation != req.incarnation
            if fresh:
                replaced = old
                if self.self_drained.get(req.name) not in (None, req.incarnation):
                    log.info("node %s is back (a new agent): its own drain ends", req.name)
                    self.draining.discard(req.name)
                    del self.self_drained[req.name]
                old = AgentHandle(
                    name=req.name, address=req.address, host=req.host,
                    target=self.agent_target(req.address, req.name),
                    incarnation=req.incarnation, version=req.version, relay=self.relay,
                )  # fmt: skip
                self._agents[req.name] = old
            assert old is not None
            handle = old
            handle.seen = seen
            # What this reply asks for is what the agent keeps until its next beat.
            handle.beat_s = beat_s = decisions.beat_interval(len(self._agents),
                                                             self.max_beats_per_s)  # fmt: skip
            links = list(req.links)
            if [(x.name, x.up) for x in links] != [(x.name, x.up) for x in handle.links]:
                self.links_changed.set()
            handle.links = links
            self.first_seen.setdefault(req.name, time.monotonic())
        if replaced is not None:
            replaced.retire()  # one channel per agent: the old incarnation's is dead
        if fresh:
            try:
                self._learn(handle)
            except errors.SnapshotterError as e:
                log.warning("could not learn the jobs of agent %s: %s", req.name, e)
        reply = pb.RegisterAgentReply(registered=req.name, beat_s=beat_s,
                                      relay_key=self.relay.public)  # fmt: skip
        if self.token is not None:
            reply.fence.CopyFrom(pb.Fence(epoch=self.token[0], id=self.token[1]))
        return reply

    def _learn(self, agent: AgentHandle) -> None:
        by_job: dict[str, list[str]] | None = None  # the store's snapshots, read once if needed
        for j in agent.stub.Jobs(common_pb2.Empty(), timeout=10).jobs:
            spec = JobSpec.from_proto(j.spec)
            with self._lock:
                rec = self._jobs.get(spec.job_id)
                learned = rec is None
                if rec is None:
                    rec = JobRecord(spec=spec, nodes=[""] * spec.nnodes)
                    self._jobs[spec.job_id] = rec
                    self._watch(rec)
                mine = {r.rank for r in j.ranks}
                other = (
                    j.state == "RUNNING" and 0 <= j.node_rank < len(rec.nodes)
                    and rec.nodes[j.node_rank] not in ("", agent.name)
                )  # fmt: skip
                if other and mine and all(rec.moved.get(r) == agent.name for r in mine):
                    other = False  # single ranks that migrated here (`migrate --rank`)
                if 0 <= j.node_rank < len(rec.nodes) and not rec.nodes[j.node_rank]:
                    rec.nodes[j.node_rank] = agent.name
            stale = other and not self._split(rec, j.node_rank, agent.name, mine)
            if stale:
                # The job moved on without this node (recovered elsewhere while its agent was
                # down): what the node still runs of it has truly lost its job.
                log.warning("job %s runs on %s now; ending its old ranks on %s",
                            spec.job_id, rec.nodes[j.node_rank], agent.name)  # fmt: skip
                agent.stub.Cancel(common_pb2.JobRef(job_id=spec.job_id), timeout=60)
                continue
            if learned:
                if by_job is None:
                    from snapshotter.coordinator.snapshots import list_snapshots

                    by_job = {}
                    for snap in list_snapshots(self.store, "").snapshots:
                        by_job.setdefault(snap.job_id, []).append(snap.snapshot_id)
                rec.snapshots = by_job.get(spec.job_id, [])
                kept = self.journal.read(spec.job_id)
                if kept is not None:
                    rec.life = kept  # its events and recoveries from before our restart
                log.info("learned job %s from agent %s", spec.job_id, agent.name)

    def _split(self, rec: JobRecord, node_rank: int, agent: str, mine: set[int]) -> bool:
        """Whether `agent`, reporting ranks `mine` of a node rank another agent holds,
        holds single ranks that migrated there (recorded then) rather than stale copies: the
        other holds none of the same ranks, and both run."""
        with self._lock:
            holder = self._agents.get(rec.nodes[node_rank])
        if holder is None or not mine:
            return False
        try:
            st = holder.stub.Status(common_pb2.JobRef(job_id=rec.spec.job_id), timeout=10)
        except errors.SnapshotterError:
            return False
        if st.state != "RUNNING" or mine & {r.rank for r in st.ranks}:
            return False
        with self._lock:
            for r in mine:
                rec.moved[r] = agent
        return True

    def _live(self, a: AgentHandle, now: float) -> bool:
        return a.seen is None or now - a.seen <= decisions.lost_after(self.agent_ttl, a.beat_s)

    def live_agents(self) -> dict[str, AgentHandle]:
        now = time.monotonic()
        with self._lock:
            return {n: a for n, a in self._agents.items() if self._live(a, now)}

    def agent_census(self) -> dict[str, int]:
        """Registered agents by state (live, lost), without asking any: for the metrics."""
        now = time.monotonic()
        with self._lock:
            live = sum(self._live(a, now) for a in self._agents.values())
            return {"live": live, "lost": len(self._agents) - live}

    def job_census(self) -> dict[str, int]:
        """Known jobs by what this coordinator last saw (busy with an operation, ended, or
        active), without asking the agents: for the metrics."""
        out: dict[str, int] = {}
        with self._lock:
            for r in self._jobs.values():
                state = r.busy or (r.final.value if r.final and r.ended else "ACTIVE")
                out[state] = out.get(state, 0) + 1
        return out

    def _place(self, nnodes: int, requested: list[str]) -> list[AgentHandle]:
        live = self.live_agents()
        if not requested:
            # A draining node takes nothing new unless named.
            live = {n: a for n, a in live.items() if n not in self.draining} or live
        return [live[n] for n in place(nnodes, requested, live)]

    def handles_by_name(self, names: list[str]) -> list[AgentHandle]:
        live = self.live_agents()
        return [live[n] for n in names]

    def link_usable(self, a: AgentHandle) -> list[bool]:
        """Whether each of a node's data-link planes is usable (up, not drained); a node
        without data links has one plane, always usable."""
        if not a.links:
            return [True]
        drained = self.drained_links.get(a.name, set())
        return [x.up and x.name not in drained for x in a.links]

    def plane_for(self, agents: list[AgentHandle], current: int = 0) -> int:
        """The plane a job on `agents` should use (its current one while usable; plane 0
        when none is: the job then waits for a link like any job without two)."""
        plane = next_plane(current, [self.link_usable(a) for a in agents])
        return current if plane is None else plane

    def nodes(self) -> pb.NodeList:
        """Every registered agent as it answers now."""
        now = time.monotonic()
        with self._lock:
            agents = sorted(self._agents.values(), key=lambda a: a.name)
        out = call_all(agents, "Ping", common_pb2.Empty(), 5)
        reply = pb.NodeList()
        for a in agents:
            row = reply.nodes.add(name=a.name, address=a.address, live=self._live(a, now),
                                  links=a.links, draining=a.name in self.draining,
                                  drained_links=sorted(self.drained_links.get(a.name, ())))
            if a.seen is not None:
                row.heartbeat_age_s = now - a.seen
            if a.name in out.results:
                row.agent.CopyFrom(out.results[a.name])
            else:
                row.error = str(out.failures[a.name])
        return reply

    def ping(self) -> pb.CoordinatorInfo:
        live = self.live_agents()
        info = pb.CoordinatorInfo(
            version=__version__,
            pid=os.getpid(),
            store=self.store_url,
            agents=sorted(live),
            incarnations={n: a.incarnation for n, a in live.items()},
            resources=common_pb2.Resources(**resources().to_dict()),
        )
        if self.token is not None:
            info.fence.CopyFrom(pb.Fence(epoch=self.token[0], id=self.token[1]))
        return info

    # ---- jobs --------------------------------------------------------------------------------

    def job(self, job_id: str) -> JobRecord:
        return self._job(job_id)

    def _job(self, job_id: str) -> JobRecord:
        with self._lock:
            rec = self._jobs.get(job_id)
        if rec is None:
            raise errors.JobNotFound(job_id)
        return rec

    def share_policy(self, rec: JobRecord) -> list[str]:
        """Hand the job's policy to its agents, which keep it with the job's spec (a restarted
        coordinator re-learns it from them); the nodes that did not take it."""
        req = agent_pb2.JobPolicy(job_id=rec.spec.job_id, policy=rec.spec.policy)
        out = call_all(self._handles(rec), "SetPolicy", req, 10)
        for node, e in out.failures.items():
            log.warning("job %s: node %s did not take the new policy: %s", rec.spec.job_id,
                        node, e)  # fmt: skip
        return list(out.failures)

    def _handles(self, rec: JobRecord) -> list[AgentHandle]:
        """The job's agents in node-rank order (nodes not yet re-learned are left out)."""
        with self._lock:
            return [self._agents[n] for n in rec.agents if n in self._agents]

    def _count_nproc(self, kind: str, agents: list[AgentHandle]) -> int:
        """--nproc-per-node auto|cpu|gpu counted on the job's agents: the fewest any of them
        has (every node of a job runs as many ranks)."""
        out = call_all(agents, "Ping", common_pb2.Empty(), 10)
        for name, e in out.failures.items():
            raise errors.ServiceUnavailable(
                f"cannot count --nproc-per-node {kind} on node {name}: {e}",
                "check `snapshotter nodes`, or give a number of ranks",
            )
        counts = {n: nproc_for(kind, i.cpus, i.gpus, f"node {n}") for n, i in out.results.items()}
        if len(set(counts.values())) > 1:
            log.info("--nproc-per-node %s differs across nodes %s: every node runs %d",
                     kind, counts, min(counts.values()))  # fmt: skip
        return min(counts.values())

    def run(self, req: pb.RunRequest, recovering: bool = False) -> pb.JobStatus:
        """`recovering`: the supervisor launches a job it stopped again, under its id."""
        spec = JobSpec(
            job_id=validate_job_id(req.job_id or new_job_id()),
            script=req.script,
            script_args=list(req.script_args),
            module=req.module,
            python=req.python,
            cwd=req.cwd,
            env=dict(req.env),
            nnodes=req.nnodes or 1,
            nproc_per_node=req.nproc_per_node or 1,
            tenant=req.tenant or DEFAULT_TENANT,
            provider_opt_out=req.provider_opt_out,
            policy=req.policy,
            recovery=req.recovery,
        )
        spec.check()
        policies.check(policies.Policy.from_dict(convert.plain(spec.policy)))
        check_recovery(spec.recovery)
        job_id = spec.job_id
        spec = dataclasses.replace(spec, sealed=self.encrypt)
        agents = self._place(spec.nnodes, list(req.nodes))
        if req.nproc_kind:
            spec = dataclasses.replace(spec, nproc_per_node=self._count_nproc(req.nproc_kind,
                                                                              agents))
        plane = self.plane_for(agents)
        with self._lock:
            old = self._jobs.get(job_id)
        if old is not None and not recovering and (old.busy or not self._phase(old).terminal):
            raise errors.InvalidArgument(
                f"job {job_id} already exists and is not finished", "choose another --job-id"
            )
        rec = JobRecord(spec=spec, nodes=[a.name for a in agents], busy="RUNNING", plane=plane)
        if recovering and old is not None:
            rec.life, rec.snapshots = old.life, list(old.snapshots)
        with self._lock:
            self._jobs[job_id] = rec
        self._watch(rec)
        ref = common_pb2.JobRef(job_id=job_id)
        try:
            # Node 0 hosts the rendezvous server; every node's ranks are pointed at it.
            rdzv = agents[0].stub.OpenRdzv(open_rdzv_req(spec), timeout=90)
            # Built once: the spec and key are the same for every node; a node's rank by name
            # (agents.index per node compared whole handles, O(N^2) at thousands of nodes).
            base = agent_pb2.LaunchRequest(spec=spec.to_proto(), rdzv=rdzv, plane=plane,
                                           seal=self.checkpoint_key(spec))  # fmt: skip
            node_rank = {a.name: i for i, a in enumerate(agents)}

            def launch(a: AgentHandle) -> agent_pb2.LaunchRequest:
                req = agent_pb2.LaunchRequest()
                req.CopyFrom(base)
                req.node_rank = node_rank[a.name]
                return req

            out = call_all(agents, "Launch", launch, 120)
            out.raise_first()
            if not caller_active():
                raise errors.ServiceUnavailable(
                    f"the caller gave up on the launch of job {job_id} (its deadline passed)",
                    "the job was stopped; launch it again",
                )
        except BaseException:
            # Every node, also one whose Launch failed or timed out: a launch still running
            # there is cancelled half-way and ends what it started.
            call_all(agents, "Cancel", ref, 60)
            call_all(agents[:1], "CloseRdzv", ref, 30)
            with self._lock:
                if recovering and old is not None:
                    self._jobs[job_id] = old
                else:
                    self._jobs.pop(job_id, None)
            raise
        finally:
            rec.busy = None
        self._forget_finished()
        return self.status(job_id)

    def _forget_finished(self) -> None:
        """Keep the newest `keep_finished_jobs` finished jobs (none older than a week): a
        coordinator that runs for weeks must not grow with the jobs it has seen."""
        forgotten = []
        with self._lock:
            finished = {j: r.ended for j, r in self._jobs.items() if r.ended is not None}
            for j in jobs_to_forget(finished, time.time(), self.keep_finished_jobs, WEEK_S):
                if self._jobs[j].busy is None:
                    self._jobs.pop(j, None)
                    forgotten.append(j)
        if forgotten:
            self.journal.forget(forgotten)

    def keep_lives(self) -> None:
        """Write the events of every job whose life changed to the store (the supervisor's
        tick calls this)."""
        with self._lock:
            lives = [(j, r.life) for j, r in self._jobs.items()]
        self.journal.save_changed(lives)

    def _phase(self, rec: JobRecord, views: list[agent_pb2.NodeJob] | None = None) -> JobPhase:
        if views is None:
            views = self._node_views(rec)
        life = rec.life
        states = [v.state for v in views]
        raw = job_phase(rec.busy, states)
        if rec.busy is None and rec.final is not None and set(states) <= _GONE_OR_ENDED:
            raw = rec.final  # some of its agents restarted since, and forgot it
        if raw.terminal:
            rec.final = raw
        phase = supervised_phase(raw, rec.busy, rec.recovers, life.recovering,
                                 bool(life.gave_up), life.cancelled)  # fmt: skip
        # When it was first seen finished (a thaw under the same id makes it live again).
        rec.ended = (rec.ended or time.time()) if phase.terminal else None
        return phase

    # ---- what the supervisor (supervisor.py, recover.py) uses ------------------------------

    def unfinished(self) -> list[JobRecord]:
        with self._lock:
            return [r for r in self._jobs.values() if r.ended is None]

    def supervised(self) -> list[JobRecord]:
        """Jobs with a snapshot policy or automatic recovery, not finished for good."""
        with self._lock:
            recs = list(self._jobs.values())
        return [r for r in recs if (r.recovers or _has_policy(r)) and r.ended is None]

    def node_views(self, rec: JobRecord) -> list[agent_pb2.NodeJob]:
        return self._node_views(rec)

    def phase_of(
        self, rec: JobRecord, views: list[agent_pb2.NodeJob] | None = None
    ) -> JobPhase:
        return self._phase(rec, views)

    def job_handles(self, rec: JobRecord) -> list[AgentHandle]:
        """The job's agents that are live now."""
        live = self.live_agents()
        return [a for a in self._handles(rec) if a.name in live]

    def unreachable(self, rec: JobRecord, timeout: float = 3.0) -> list[str]:
        """The job's nodes that do not answer now (before their heartbeats run out: the
        peers of a dead node fail at once, and must not be blamed for it)."""
        with self._lock:
            names = rec.agents
            handles = [self._agents.get(n) for n in names]
        missing = [n for n, h in zip(names, handles, strict=True) if n and h is None]
        present = [h for h in handles if h is not None]
        out = call_all(present, "Ping", common_pb2.Empty(), timeout)
        return missing + [a.name for a in present if a.name in out.failures]

    def heartbeat_age(self, name: str) -> float | None:
        with self._lock:
            a = self._agents.get(name)
        return None if a is None or a.seen is None else time.monotonic() - a.seen

    def protected(self) -> set[str]:
        """Snapshots no retention may delete now: read by a thaw or written by a freeze."""
        with self._lock:
            return set(self.reading) | set(self.writing)

    def auto_inputs(self, rec: JobRecord) -> policies.AutoInputs:
        now = time.monotonic()
        live = self.live_agents()
        with self._lock:
            node_s = sum(now - t for n, t in self.first_seen.items() if n in live)
        rate = policies.FailureRate(node_seconds=node_s, failures=self.failures_seen)
        return policies.auto_interval(
            list(rec.life.stalls), rate, rec.spec.nnodes, self.prior_node_mtbf_s
        )

    def _node_views(self, rec: JobRecord) -> list[agent_pb2.NodeJob]:
        if rec.busy == "THAWING":
            return []
        ref = common_pb2.JobRef(job_id=rec.spec.job_id)
        out = call_all(self._handles(rec), "Status", ref, 10)
        views = list(out.results.values())
        # A node that does not answer but still sends heartbeats may be an agent restarting
        # under its keeper (its ranks train on): not a failure until its heartbeat runs out.
        live = self.live_agents()
        views += [agent_pb2.NodeJob(job_id=rec.spec.job_id,
                                    state="UNREACHABLE" if n in live else "FAILED")
                  for n in out.failures]  # fmt: skip
        return views

    def status(self, job_id: str) -> pb.JobStatus:
        rec = self._job(job_id)
        views = self._node_views(rec)
        phase = self._phase(rec, views)
        ranks = sorted((r for v in views for r in v.ranks), key=lambda r: r.rank)
        st = pb.JobStatus(
            job_id=job_id,
            tenant=rec.spec.tenant,
            state=phase.value,
            nodes=rec.agents,
            nnodes=rec.spec.nnodes,
            nproc_per_node=rec.spec.nproc_per_node,
            script=rec.spec.script,
            ranks=ranks,
            snapshots=rec.snapshots,
            thawed_from=rec.thawed_from or "",
            policy=rec.spec.policy,
            recovery=rec.spec.recovery,
            recoveries=len(rec.life.recoveries),
            events=rec.life.newest(),
            gave_up=rec.life.gave_up,
            plane=rec.plane,
        )
        if phase.terminal:
            codes = [r.exit_code if r.HasField("exit_code") else None for r in ranks]
            st.exit_code = exit_code(phase, codes)
        return st

    def jobs(self) -> pb.JobList:
        with self._lock:
            ids = list(self._jobs)
        out = pb.JobList()
        for j in ids:
            try:
                out.jobs.append(self.status(j))
            except errors.JobNotFound:
                continue
        return out

    def wait(self, job_id: str, timeout: float) -> pb.JobStatus:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(job_id)
            if JobPhase(st.state).terminal:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                return st
            rec = self._job(job_id)
            if rec.busy is None:
                self._wait_agents(rec, min(left, 5.0))
            else:
                time.sleep(min(left, 0.5))

    def _wait_agents(self, rec: JobRecord, step: float) -> None:
        req = common_pb2.WaitRequest(job_id=rec.spec.job_id, timeout_s=step)
        call_all(self._handles(rec), "Wait", req, step + 10)

    def cancel(self, job_id: str) -> pb.JobStatus:
        rec = self._job(job_id)
        rec.life.cancelled = True  # on purpose: never recovered
        ref = common_pb2.JobRef(job_id=job_id)
        handles = self._handles(rec)

        def cancel_on(agents: list[AgentHandle]) -> dict[str, BaseException]:
            out = call_all(agents, "Cancel", ref, 60)
            # A node that no longer knows the job has nothing left to end; a lost node's
            # agent ends what its predecessor left when it comes back (agent/orphans.py).
            live = self.live_agents()
            return {n: e for n, e in out.failures.items()
                    if n in live and not isinstance(e, errors.JobNotFound)}  # fmt: skip

        failed = cancel_on(handles)
        if failed:
            # Once more, on the agents as registered now: a node whose agent just restarted
            # refuses the old channel's handshake, and its ranks must not be left running.
            time.sleep(1.0)
            failed = cancel_on([a for a in self._handles(rec) if a.name in failed])
        if failed:
            node, e = next(iter(failed.items()))
            cause = e.cause if isinstance(e, errors.SnapshotterError) else f"{type(e).__name__}"
            log.warning("cancel of job %s: node(s) %s did not confirm: %s", job_id,
                        ",".join(failed), e)  # fmt: skip
            raise errors.ServiceUnavailable(
                f"job {job_id} was cancelled on every node but {', '.join(failed)}, whose "
                f"agent did not confirm ({cause}); its ranks there may still run",
                f"retry `snapshotter cancel {job_id}`; see `snapshotter nodes` for node {node}",
            )
        return self.status(job_id)

    def logs(self, req: common_pb2.LogsRequest) -> Iterator[common_pb2.LogChunk]:
        rec = self._job(req.job_id)
        agents = self._handles(rec)
        if req.HasField("rank"):
            node = req.rank // rec.spec.nproc_per_node
            if not 0 <= node < len(agents):
                raise errors.InvalidArgument(
                    f"job {rec.spec.job_id} has no rank {req.rank}",
                    f"ranks are 0..{rec.spec.world_size - 1}",
                )
            agents = [agents[node]]
        for a in agents:
            yield from a.stub.Logs(req)

    def running_jobs(self) -> list[str]:
        with self._lock:
            ids = list(self._jobs)
        return [j for j in ids if self._is_active(j)]

    def _is_active(self, job_id: str) -> bool:
        try:
            return not JobPhase(self.status(job_id).state).terminal
        except errors.SnapshotterError:
            return False

    # ---- policies, events, drain -------------------------------------------------------------

    def events(self, job_id: str) -> pb.EventList:
        rec = self._job(job_id)
        return pb.EventList(job_id=job_id, events=rec.life.newest(len(rec.life.events)))

    def registered(self, node: str) -> bool:
        with self._lock:
            return node in self._agents

    def jobs_on(self, node: str) -> list[JobRecord]:
        with self._lock:
            return [r for r in self._jobs.values() if node in r.agents]

    def unfinished_on(self, node: str) -> list[JobRecord]:
        return [r for r in self.unfinished() if node in r.agents]

    def holds(self, node: str, rec: JobRecord) -> bool:
        """Whether the agent of `node` holds the job (or is busy with it: a thaw), as far as
        it answers (one that does not may still hold it)."""
        a = self.live_agents().get(node)
        if a is None or rec.busy is not None:
            return True
        try:
            a.stub.Status(common_pb2.JobRef(job_id=rec.spec.job_id), timeout=10)
        except errors.JobNotFound:
            return False
        except errors.SnapshotterError:
            return True
        return True

    def drain_mark(self, node: str, by_itself: bool = False) -> None:
        """Nothing new is placed on `node` (`undrain` undoes it). `by_itself`: the node's agent
        drains itself as it stops (SIGTERM, a preStop hook): the mark ends with that agent,
        so the node takes jobs again once a new agent registers; an operator's drain stays
        until undone."""
        with self._lock:
            a = self._agents.get(node)
            if not by_itself:
                self.self_drained.pop(node, None)
            elif node not in self.draining and a is not None:
                self.self_drained[node] = a.incarnation
            self.draining.add(node)

    def undrain(self, node: str) -> None:
        with self._lock:
            self.draining.discard(node)
            self.self_drained.pop(node, None)

    # ---- freeze / thaw -----------------------------------------------------------------------

    def freeze(
        self, req: pb.FreezeRequest, prepare_timeout: float | None = None
    ) -> Iterator[pb.FreezeEvent]:
        """`prepare_timeout`: how long a rank may take to report its counts (the supervisor's
        freezes give little: a rank that cannot answer at once is stopped or hung)."""
        return metrics.observed("freeze", self._freeze(req, prepare_timeout))

    def _freeze(
        self, req: pb.FreezeRequest, prepare_timeout: float | None
    ) -> Iterator[pb.FreezeEvent]:
        rec = self._job(req.job_id)
        with self.holding(rec, JobPhase.FREEZING):
            self._check_quota(rec)
            timeout = req.quiesce_timeout_s if req.HasField("quiesce_timeout_s") else None
            settings = FreezeSettings(
                quiesce_timeout=timeout or FreezeSettings.quiesce_timeout,
                prepare_timeout=prepare_timeout or FreezeSettings.prepare_timeout,
            )
            steps = rec.life.progress.steps

            def committed(sid: str) -> None:
                rec.snapshots.append(sid)
                if steps is not None:
                    rec.life.snapshot_steps[sid] = steps

            op = FreezeOperation(rec.spec, self._handles(rec), self.store, req.stop, settings,
                                 on_committed=committed, signer=self.signer,
                                 seal=self.seal_for(rec.spec),
                                 current=lambda n: self.live_agents().get(n))  # fmt: skip
            op.plane = rec.plane
            with self.writing_snapshot(op.snapshot_id):
                for ev in op.run():
                    if ev.HasField("done"):
                        if ev.done.stats.HasField("stall_s"):
                            rec.life.stalls.append(ev.done.stats.stall_s)
                        # It held collectives on purpose: no rank was hung meanwhile.
                        rec.life.progress = detect.reset(rec.life.progress, time.monotonic())
                    yield ev

    def _watch(self, rec: JobRecord) -> None:
        """Send the job's events to its tenant's webhook (if it has one)."""
        hooks, job_id, tenant = self.webhooks, rec.spec.job_id, rec.spec.tenant
        if hooks is not None:
            rec.life.sink = lambda ev: hooks.emit(tenant, job_id, ev)

    def _check_quota(self, rec: JobRecord) -> None:
        """Refuse a freeze that would take the job's tenant past its limits (quotas.py)."""
        tenant = rec.spec.tenant
        limits = self.limits.get(tenant)
        if limits == quotas.Limits():
            return
        with self._lock:
            others = [r for r in self._jobs.values() if r is not rec and r.spec.tenant == tenant]
        freezing = sum(1 for r in others if r.busy == JobPhase.FREEZING.value)
        stored = 0
        if limits.max_stored_bytes is not None:
            listed = snapshots.list_snapshots(self.store, "").snapshots
            stored = sum(s.stored_bytes for s in listed if s.tenant == tenant)
        quotas.check_freeze(tenant, limits, freezing, stored)

    def seal_for(self, spec: JobSpec) -> Seal | None:
        """The data key a new snapshot of this job is sealed with (None: encryption off)."""
        return self.data_keys.current(spec.tenant) if self.encrypt else None

    def checkpoint_key(self, spec: JobSpec) -> common_pb2.DataKey | None:
        """The key a job's agents seal its application checkpoints with (None: plaintext)."""
        seal = self.seal_for(spec) if spec.sealed else None
        return None if seal is None else convert.data_key(seal)

    @contextlib.contextmanager
    def writing_snapshot(self, snapshot_id: str | None) -> Iterator[None]:
        """Chunks of `snapshot_id` are being written and read: never garbage to gc meanwhile."""
        if snapshot_id:
            with self._lock:
                self.writing.add(snapshot_id)
        try:
            yield
        finally:
            if snapshot_id:
                with self._lock:
                    self.writing.discard(snapshot_id)

    @contextlib.contextmanager
    def holding(self, rec: JobRecord, busy: JobPhase) -> Iterator[None]:
        """Hold a running job for one operation (a freeze, a migration): refused while
        another holds it, or when the job is not running."""
        verb = {JobPhase.FREEZING: "frozen", JobPhase.MIGRATING: "migrated",
                JobPhase.REROUTING: "rerouted"}[busy]  # fmt: skip
        if not rec.lock.acquire(blocking=False):
            raise errors.FreezeRefused(
                f"another freeze, thaw or migration of job {rec.spec.job_id} is in progress",
                "wait for it to finish (`snapshotter status`), then retry",
            )
        try:
            phase = self._phase(rec)
            if phase is not JobPhase.RUNNING:
                raise errors.FreezeRefused(
                    f"job {rec.spec.job_id} is {phase.value}; only a running job can be {verb}",
                    "`snapshotter list` shows its snapshots; `snapshotter thaw` resumes one",
                )
            rec.busy = busy.value
            yield
        finally:
            rec.busy = None
            rec.lock.release()

    def thaw(self, req: pb.ThawRequest, recovering: bool = False) -> Iterator[pb.ThawEvent]:
        """`recovering`: the supervisor thaws a job it stopped under the same id."""
        return metrics.observed("thaw", self._thaw(req, recovering))

    def _thaw(self, req: pb.ThawRequest, recovering: bool) -> Iterator[pb.ThawEvent]:
        snap = req.snapshot_id
        reader = SnapshotReader(self.store, snap)
        body = reader.manifest_body()
        # Before anything starts: who committed it, and that nothing changed since.
        signer = self.keyring.verify(snap, body, reader.signature(),
                                     allow_unsigned=req.allow_unsigned)  # fmt: skip
        if not signer:
            log.warning("thawing unsigned snapshot %s (--allow-unsigned)", snap)
        manifest = reader.manifest()
        meta = dict(manifest.meta)
        sealed = manifest.sealed
        # Before any node is asked: a snapshot whose key is not held here fails now.
        seal = None if sealed is None else self.data_keys.get(sealed.tenant, sealed.key_id)
        spec0 = JobSpec.from_dict(meta["job"])
        with self._lock:
            known = list(self._jobs)
        # Only the source's id and the requested one can clash; ask the agents whether they run.
        candidates = {spec0.job_id, req.job_id or None}
        if recovering:
            candidates.discard(req.job_id)
        active = [j for j in candidates if j in known and self._is_active(j)]
        job_id = validate_job_id(thaw_job_id(spec0.job_id, req.job_id or None, active, known))
        # Sealed as this coordinator seals now (a snapshot from before the flag says nothing).
        spec = dataclasses.replace(spec0.with_job_id(job_id), sealed=self.encrypt)
        agents = self._place(spec.nnodes, list(req.nodes))
        plane = self.plane_for(agents)
        rec = JobRecord(spec=spec, nodes=[a.name for a in agents], busy="THAWING", thawed_from=snap,
                        plane=plane)  # fmt: skip
        # A job this coordinator does not know (frozen before its restart) goes on with its
        # history from the store.
        kept = self.journal.read(job_id) if job_id not in known else None
        with self._lock:
            if job_id in self._jobs and self._jobs[job_id].busy:
                raise errors.InvalidArgument(
                    f"job {job_id} is busy", "choose another --job-id for the thaw"
                )
            prev = self._jobs.get(job_id)
            if prev is not None:
                rec.snapshots = list(prev.snapshots)
                # The same job goes on: its events, policy state and recoveries with it.
                rec.life = prev.life
            elif kept is not None:
                rec.life = kept
            self._jobs[job_id] = rec
            self.reading.add(snap)
        self._watch(rec)
        if not recovering:
            rec.life.gave_up = ""  # a person thawed it: supervised again
            rec.life.cancelled = False
        # A fork of a job that still runs must leave its original's files alone.
        fork_of_live = spec0.job_id in active and job_id != spec0.job_id
        try:
            yield from ThawOperation(snap, meta, spec, agents, fork_of_live_job=fork_of_live,
                                     plane=plane, seal=seal,
                                     digest=signing.manifest_digest(body),
                                     checkpoint_key=self.checkpoint_key(spec)).run()  # fmt: skip
            rec.life.progress = detect.reset(rec.life.progress, time.monotonic())
        except BaseException:
            with self._lock:
                if prev is not None:
                    self._jobs[job_id] = prev
                else:
                    self._jobs.pop(job_id, None)
            raise
        finally:
            rec.busy = None
            with self._lock:
                self.reading.discard(snap)


def node_caller(node: str, what: str, next_step: str) -> Any:
    """The caller, refused when it holds a node certificate of another node than `node`."""
    who = caller()
    if who is not None and who.via == "certificate" and who.name != node:
        raise errors.PermissionDenied(
            f"node certificate {who.name!r} may not {what} node {node!r}", next_step,
            right="REGISTER", identity=str(who),
        )  # fmt: skip
    return who


def _has_policy(rec: JobRecord) -> bool:
    p = rec.spec.policy
    return p.HasField("every_s") or p.auto or p.HasField("every_steps") or p.HasField("keep")


def check_recovery(r: common_pb2.Recovery) -> None:
    """Raises: InvalidArgument naming the flag that is wrong."""
    if r.mode not in ("", "off", "auto"):
        raise errors.InvalidArgument(f"--recover {r.mode!r} is not known", "use auto or off")
    for flag, v in (("--max-recoveries", r.max_tries), ("--recovery-window", r.window_s),
                    ("--hang-deadline", r.hang_deadline_s)):  # fmt: skip
        if v < 0:
            raise errors.InvalidArgument(f"{flag} {v} is negative", "give a positive value")
