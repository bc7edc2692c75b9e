"""The coordinator: owns jobs and snapshots, and orchestrates node agents.

It keeps which job runs on which agents and which operation holds a job; the agents own the
processes, and the object store's manifests are the truth about snapshots. Decisions are in
coordinator/decisions.py; the phased operations in freeze.py and thaw.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from coordinator.agents import AgentHandle, on_all, open_store_req
from coordinator.decisions import JobPhase, exit_code, job_phase, thaw_job_id
from coordinator.freeze import FreezeOperation, FreezeSettings
from coordinator.gc import DEFAULT_MIN_AGE_S, gc_report
from coordinator.thaw import ThawOperation
from snapshotter import errors
from snapshotter.agent.retention import jobs_to_forget
from snapshotter.launch.spec import JobSpec, new_job_id, validate_job_id
from snapshotter.procutil import resources
from snapshotter.rpc.wire import caller_active
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.transfer import SnapshotReader, delete_snapshot, list_snapshots

log = logging.getLogger(__name__)
Msg = dict[str, Any]
COORDINATOR_SERVICE = "snapshotter.Coordinator"
WEEK_S = 7 * 24 * 3600.0


@dataclass
class JobRecord:
    spec: JobSpec
    nodes: list[str]
    busy: str | None = None
    snapshots: list[str] = field(default_factory=list)
    thawed_from: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Wall time the job was first seen finished (None while it is not).
    ended: float | None = None


class Coordinator:
    """Jobs and agents as this coordinator knows them. Nothing here must outlive it: after a
    restart, agents re-register (their heartbeat) and report their jobs, and snapshots are
    read from the store, so a new coordinator picks up where the old one was."""

    def __init__(
        self,
        store: ObjectStore,
        store_url: str,
        token: tuple[int, str] | None = None,
        agent_ttl: float = 15.0,
        keep_finished_jobs: int = 100,
    ) -> None:
        self.store = store
        self.store_url = store_url
        self.token = token
        self.agent_ttl = agent_ttl
        self.keep_finished_jobs = keep_finished_jobs
        self._agents: dict[str, AgentHandle] = {}
        self._jobs: dict[str, JobRecord] = {}
        # Snapshots this coordinator's freezes are writing now: never garbage to gc.
        self._writing: set[str] = set()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- agents
    def register_agent(
        self, name: str, address: str, host: str, heartbeat: bool = False, incarnation: str = ""
    ) -> Msg:
        """An agent announces itself (at start, then as a heartbeat). A new, moved or restarted
        agent gets a new handle (a fresh connection) and is asked for its jobs, so a restarted
        coordinator re-learns what runs where."""
        seen = time.monotonic() if heartbeat else None
        with self._lock:
            old = self._agents.get(name)
            fresh = old is None or old.address != address or old.incarnation != incarnation
            replaced = old if fresh else None
            if old is None or fresh:
                old = AgentHandle(
                    name=name, address=address, host=host, fence=self.token,
                    incarnation=incarnation,
                )  # fmt: skip
                self._agents[name] = old
            handle = old
            handle.seen = seen
        if replaced is not None:
            replaced.close()  # one channel per agent: the old incarnation's is dead
        if fresh:
            try:
                self._learn(handle)
            except errors.SnapshotterError as e:
                log.warning("could not learn the jobs of agent %s: %s", name, e)
        return {"registered": name, "fence": list(self.token) if self.token else None}

    def _learn(self, agent: AgentHandle) -> None:
        by_job: dict[str, list[str]] | None = None  # the store's snapshots, read once if needed
        for j in agent.call("Jobs", timeout=10)["jobs"]:
            spec = JobSpec.from_dict(j["spec"])
            node_rank = int(j["node_rank"])
            with self._lock:
                rec = self._jobs.get(spec.job_id)
                if rec is None:
                    rec = JobRecord(spec=spec, nodes=[""] * spec.nnodes)
                    self._jobs[spec.job_id] = rec
                    learned = True
                else:
                    learned = False
                if 0 <= node_rank < len(rec.nodes) and not rec.nodes[node_rank]:
                    rec.nodes[node_rank] = agent.name
            if learned:
                if by_job is None:
                    by_job = {}
                    for snap in self.list_snapshots({})["snapshots"]:
                        by_job.setdefault(snap["job_id"], []).append(snap["snapshot_id"])
                rec.snapshots = by_job.get(spec.job_id, [])
                log.info("learned job %s from agent %s", spec.job_id, agent.name)

    def _live(self, a: AgentHandle, now: float) -> bool:
        return a.seen is None or now - a.seen <= self.agent_ttl

    def _agents_for(self, nnodes: int, nodes: list[str] | None) -> list[AgentHandle]:
        now = time.monotonic()
        with self._lock:
            agents = {n: a for n, a in self._agents.items() if self._live(a, now)}
        if not agents:
            raise errors.ServiceUnavailable(
                "no node agent is registered with the coordinator",
                "start an agent on each node (`snapshotter agent`), or use the embedded default",
            )
        if nodes:
            unknown = [n for n in nodes if n not in agents]
            if unknown:
                raise errors.InvalidArgument(
                    f"unknown node(s) {unknown}", f"registered nodes: {sorted(agents)}"
                )
            chosen = [agents[n] for n in nodes]
        else:
            chosen = [agents[n] for n in sorted(agents)][:nnodes]
        if len(chosen) != nnodes:
            raise errors.InvalidArgument(
                f"the job needs {nnodes} node(s) but {len(chosen)} are available",
                f"registered nodes: {sorted(agents)}",
            )
        return chosen

    def _job(self, job_id: str) -> JobRecord:
        with self._lock:
            rec = self._jobs.get(job_id)
        if rec is None:
            raise errors.JobNotFound(job_id)
        return rec

    def _handles(self, rec: JobRecord) -> list[AgentHandle]:
        """The job's agents in node-rank order (nodes not yet re-learned are left out)."""
        with self._lock:
            return [self._agents[n] for n in rec.nodes if n in self._agents]

    # ----------------------------------------------------------------- jobs
    def run(self, req: Msg) -> Msg:
        job_id = validate_job_id(req.get("job_id") or new_job_id())
        nnodes = int(req.get("nnodes", 1))
        nproc = int(req.get("nproc_per_node", 1))
        if nnodes < 1 or nproc < 1:
            raise errors.InvalidArgument(
                f"--nnodes {nnodes} / --nproc-per-node {nproc} must be >= 1", "fix the flags"
            )
        spec = JobSpec(
            job_id=job_id,
            script=req["script"],
            script_args=list(req.get("script_args", [])),
            module=bool(req.get("module", False)),
            python=req["python"],
            cwd=req["cwd"],
            env=dict(req["env"]),
            nnodes=nnodes,
            nproc_per_node=nproc,
        )
        agents = self._agents_for(nnodes, req.get("nodes"))
        with self._lock:
            old = self._jobs.get(job_id)
            if old is not None and (old.busy or not self._phase(old).terminal):
                raise errors.InvalidArgument(
                    f"job {job_id} already exists and is not finished", "choose another --job-id"
                )
            rec = JobRecord(spec=spec, nodes=[a.name for a in agents], busy="RUNNING")
            self._jobs[job_id] = rec
        try:
            # Node 0 hosts the rendezvous store; every node's ranks are pointed at it.
            store_at = agents[0].call("OpenStore", open_store_req(spec), timeout=90)
            res, fail = on_all(
                agents,
                lambda a: a.call(
                    "Launch",
                    {"spec": spec.to_dict(), "node_rank": agents.index(a), "store": store_at},
                    timeout=120,
                ),
            )
            if fail:
                raise next(iter(fail.values()))
            if not caller_active():
                raise errors.ServiceUnavailable(
                    f"the caller gave up on the launch of job {job_id} (its deadline passed)",
                    "the job was stopped; launch it again",
                )
        except BaseException:
            # Every node, also one whose Launch failed or timed out: a launch still running
            # there is cancelled half-way and ends what it started.
            on_all(agents, lambda a: a.call("Cancel", {"job_id": job_id}, timeout=60))
            on_all(agents[:1], lambda a: a.call("CloseStore", {"job_id": job_id}))
            with self._lock:
                self._jobs.pop(job_id, None)
            raise
        finally:
            rec.busy = None
        self._forget_finished()
        return self.status(job_id)

    def _forget_finished(self) -> None:
        """Keep the newest `keep_finished_jobs` finished jobs (and none older than a week):
        a coordinator that runs for weeks must not grow with the jobs it has seen."""
        with self._lock:
            finished = {j: r.ended for j, r in self._jobs.items() if r.ended is not None}
            for j in jobs_to_forget(finished, time.time(), self.keep_finished_jobs, WEEK_S):
                if self._jobs[j].busy is None:
                    self._jobs.pop(j, None)

    def _phase(self, rec: JobRecord, views: list[Msg] | None = None) -> JobPhase:
        if views is None:
            views = self._node_views(rec)
        phase = job_phase(rec.busy, [v["state"] for v in views])
        # When it was first seen finished (a thaw under the same id makes it live again).
        rec.ended = (rec.ended or time.time()) if phase.terminal else None
        return phase

    def _node_views(self, rec: JobRecord) -> list[Msg]:
        if rec.busy == "THAWING":
            return []
        res, fail = on_all(
            self._handles(rec), lambda a: a.call("Status", {"job_id": rec.spec.job_id}, timeout=10)
        )
        views = list(res.values())
        for name, e in fail.items():
            views.append({"state": "FAILED", "node": name, "error": str(e), "ranks": []})
        return views

    def status(self, job_id: str) -> Msg:
        rec = self._job(job_id)
        views = self._node_views(rec)
        phase = self._phase(rec, views)
        ranks = sorted((r for v in views for r in v.get("ranks", [])), key=lambda r: r["rank"])
        return {
            "job_id": job_id,
            "state": phase.value,
            "nodes": rec.nodes,
            "nnodes": rec.spec.nnodes,
            "nproc_per_node": rec.spec.nproc_per_node,
            "script": rec.spec.script,
            "ranks": ranks,
            "snapshots": rec.snapshots,
            "thawed_from": rec.thawed_from,
            "exit_code": exit_code(phase, [r.get("exit_code") for r in ranks])
            if phase.terminal
            else None,
        }

    def jobs(self) -> Msg:
        with self._lock:
            ids = list(self._jobs)
        out = []
        for j in ids:
            try:
                out.append(self.status(j))
            except errors.JobNotFound:
                continue
        return {"jobs": out}

    def wait(self, job_id: str, timeout: float) -> Msg:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(job_id)
            if JobPhase(st["state"]).terminal:
                return st
            left = deadline - time.monotonic()
            if left <= 0:
                return st
            rec = self._job(job_id)
            if rec.busy is None:
                step = min(left, 5.0)
                on_all(
                    self._handles(rec),
                    lambda a, step=step: a.call(  # type: ignore[misc]
                        "Wait", {"job_id": job_id, "timeout": step}, timeout=step + 10
                    ),
                )
            else:
                time.sleep(min(left, 0.5))

    def cancel(self, job_id: str) -> Msg:
        rec = self._job(job_id)
        on_all(self._handles(rec), lambda a: a.call("Cancel", {"job_id": job_id}))
        return self.status(job_id)

    def logs(self, req: Msg) -> Iterator[Msg]:
        rec = self._job(req["job_id"])
        rank = req.get("rank")
        agents = self._handles(rec)
        if rank is not None:
            node = int(rank) // rec.spec.nproc_per_node
            if not 0 <= node < len(agents):
                raise errors.InvalidArgument(
                    f"job {rec.spec.job_id} has no rank {rank}",
                    f"ranks are 0..{rec.spec.world_size - 1}",
                )
            agents = [agents[node]]
        for a in agents:
            yield from a.stream("Logs", req)

    # ----------------------------------------------------------------- freeze / thaw
    def freeze(self, req: Msg) -> Iterator[Msg]:
        rec = self._job(req["job_id"])
        if not rec.lock.acquire(blocking=False):
            raise errors.FreezeRefused(
                f"another freeze or thaw of job {rec.spec.job_id} is in progress",
                "wait for it to finish (`snapshotter status`), then retry",
            )
        try:
            phase = self._phase(rec)
            if phase is not JobPhase.RUNNING:
                raise errors.FreezeRefused(
                    f"job {rec.spec.job_id} is {phase.value}; only a running job can be frozen",
                    "`snapshotter list` shows its snapshots; `snapshotter thaw` resumes one",
                )
            rec.busy = JobPhase.FREEZING.value
            settings = FreezeSettings(
                quiesce_timeout=float(req.get("quiesce_timeout") or FreezeSettings.quiesce_timeout)
            )
            op = FreezeOperation(
                rec.spec,
                self._handles(rec),
                self.store,
                bool(req.get("stop")),
                settings,
                on_committed=rec.snapshots.append,
            )
            with self._lock:
                self._writing.add(op.snapshot_id)
            try:
                yield from op.run()
            finally:
                with self._lock:
                    self._writing.discard(op.snapshot_id)
        finally:
            rec.busy = None
            rec.lock.release()

    def thaw(self, req: Msg) -> Iterator[Msg]:
        snap = req["snapshot_id"]
        manifest = SnapshotReader(self.store, snap).manifest()
        meta = manifest.meta
        spec0 = JobSpec.from_dict(meta["job"])
        with self._lock:
            known = list(self._jobs)
        # Only the source's id and the requested one can clash; ask the agents whether they run.
        candidates = {spec0.job_id, req.get("job_id")}
        active = [j for j in candidates if j in known and self._is_active(j)]
        job_id = thaw_job_id(spec0.job_id, req.get("job_id"), active, known)
        validate_job_id(job_id)
        spec = spec0.with_job_id(job_id)
        agents = self._agents_for(spec.nnodes, req.get("nodes"))
        rec = JobRecord(spec=spec, nodes=[a.name for a in agents], busy="THAWING", thawed_from=snap)
        with self._lock:
            if job_id in self._jobs and self._jobs[job_id].busy:
                raise errors.InvalidArgument(
                    f"job {job_id} is busy", "choose another --job-id for the thaw"
                )
            prev = self._jobs.get(job_id)
            if prev is not None:
                rec.snapshots = list(prev.snapshots)
            self._jobs[job_id] = rec
        try:
            yield from ThawOperation(snap, dict(meta), spec, agents).run()
        except BaseException:
            with self._lock:
                if prev is not None:
                    self._jobs[job_id] = prev
                else:
                    self._jobs.pop(job_id, None)
            raise
        finally:
            rec.busy = None

    def _is_active(self, job_id: str) -> bool:
        try:
            return not JobPhase(self.status(job_id)["state"]).terminal
        except errors.SnapshotterError:
            return False

    # ----------------------------------------------------------------- snapshots
    def list_snapshots(self, req: Msg) -> Msg:
        job = req.get("job_id")
        out = []
        for sid in list_snapshots(self.store):
            try:
                m = SnapshotReader(self.store, sid).manifest()
            except errors.SnapshotterError:
                continue
            if job and m.meta.get("source_job") != job:
                continue
            out.append(_summary(sid, m))
        return {"snapshots": sorted(out, key=lambda s: s["created"])}

    def show(self, snapshot_id: str) -> Msg:
        m = SnapshotReader(self.store, snapshot_id).manifest()
        return {
            **_summary(snapshot_id, m),
            "meta": {k: v for k, v in m.meta.items() if k != "job"},
            "job": {k: v for k, v in m.meta["job"].items() if k != "env"},
        }

    def delete(self, snapshot_id: str) -> Msg:
        SnapshotReader(self.store, snapshot_id).manifest()  # SnapshotNotFound if absent
        delete_snapshot(self.store, snapshot_id)
        return {"deleted": snapshot_id}

    def gc(self, req: Msg) -> Msg:
        """Orphaned chunks (no manifest) older than the grace period, listed or deleted. The
        grace period also covers freezes of a coordinator that died mid-upload (their agents
        may still be writing)."""
        with self._lock:
            writing = set(self._writing)
        return gc_report(
            self.store,
            writing,
            now=time.time(),
            min_age_s=float(req.get("min_age_s", DEFAULT_MIN_AGE_S)),
            delete=bool(req.get("delete")),
        )

    def running_jobs(self) -> list[str]:
        with self._lock:
            ids = list(self._jobs)
        return [j for j in ids if self._is_active(j)]

    def ping(self) -> Msg:
        now = time.monotonic()
        with self._lock:
            live = {n: a.incarnation for n, a in self._agents.items() if self._live(a, now)}
        return {
            "pid": os.getpid(),
            "store": self.store_url,
            "agents": sorted(live),
            "incarnations": live,
            "fence": list(self.token) if self.token else None,
            "resources": resources().to_dict(),
        }

    def nodes(self) -> Msg:
        """Every registered agent as it answers now: address, incarnation, last heartbeat,
        its resources (what must not grow with the jobs it ran) and its jobs."""
        now = time.monotonic()
        with self._lock:
            agents = sorted(self._agents.values(), key=lambda a: a.name)
        res, fail = on_all(agents, lambda a: a.call("Ping", timeout=5))
        out = []
        for a in agents:
            row: Msg = {
                "name": a.name,
                "address": a.address,
                "live": self._live(a, now),
                "heartbeat_age_s": None if a.seen is None else now - a.seen,
            }
            if a.name in res:
                row.update({k: v for k, v in res[a.name].items() if k != "node"})
            else:
                row["error"] = str(fail[a.name])
            out.append(row)
        return {"nodes": out}


def _summary(sid: str, m: Any) -> Msg:
    meta = m.meta
    return {
        "snapshot_id": sid,
        "job_id": meta.get("source_job"),
        "created": m.created_at,
        "ranks": len(meta.get("ranks", [])),
        "nodes": meta.get("nodes", []),
        "stored_bytes": m.stored_size,
        "raw_bytes": m.raw_size,
        "stats": meta.get("stats", {}),
    }


def coordinator_service(c: Coordinator) -> tuple[dict[str, Any], dict[str, Any]]:
    unary = {
        "Ping": lambda req: c.ping(),
        "Nodes": lambda req: c.nodes(),
        "RegisterAgent": lambda req: c.register_agent(
            req["name"], req["address"], req["host"], bool(req.get("heartbeat")),
            str(req.get("incarnation", "")),
        ),  # fmt: skip
        "Run": c.run,
        "Status": lambda req: c.status(req["job_id"]),
        "Jobs": lambda req: c.jobs(),
        "Wait": lambda req: c.wait(req["job_id"], float(req.get("timeout", 30))),
        "Cancel": lambda req: c.cancel(req["job_id"]),
        "List": c.list_snapshots,
        "Show": lambda req: c.show(req["snapshot_id"]),
        "Delete": lambda req: c.delete(req["snapshot_id"]),
        "Gc": c.gc,
    }
    streaming = {"Freeze": c.freeze, "Thaw": c.thaw, "Logs": c.logs}
    return unary, streaming
