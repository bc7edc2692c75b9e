"""Draining one job off a node that is going away (preemption, maintenance).

migrate  --recover auto and a healthy node free: the node's ranks move
         there agent to agent while the others stay in memory (coordinator/migrate.py);
         if that fails, the job is left where it was and the freeze below follows
freeze   freeze-and-stop, bounded by the grace period (quiesce gets half of what is left
         once a freeze or thaw already under way, a policy snapshot say, has ended)
fallback the freeze did not commit in time: the job's newest committed snapshot is what
         it resumes from (it keeps running until the node goes; a freeze still under way
         may yet commit)
thaw     --recover auto: thawed on healthy nodes (never a draining one)
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from snapshotter import errors, parallel
from snapshotter.coordinator import migrate, snapshots
from snapshotter.coordinator.core import node_caller
from snapshotter.coordinator.decisions import JobPhase, recovery_nodes
from snapshotter.v1 import coordinator_pb2

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator, JobRecord

pb = coordinator_pb2


DRAINED = (JobPhase.RUNNING, JobPhase.FREEZING, JobPhase.MIGRATING, JobPhase.THAWING)


def _await_idle(c: Coordinator, job_id: str, deadline: float) -> None:
    """Until no freeze or thaw holds the job (its record is replaced by a thaw), or `deadline`."""
    while c.job(job_id).busy is not None and time.monotonic() < deadline:
        time.sleep(0.2)


def _migrated(c: Coordinator, rec: JobRecord, node: str, deadline: float) -> pb.DrainedJob | None:
    """Move the job's ranks off `node` onto a healthy node (its other ranks stay in memory);
    None when a migration does not apply or failed (the job then runs as before)."""
    if not rec.recovers or node not in rec.nodes:
        return None
    _await_idle(c, rec.spec.job_id, deadline)
    try:
        nodes = recovery_nodes(rec.nodes, [node], c.live_agents(),
                               list(rec.spec.recovery.spares), c.draining)  # fmt: skip
        to = nodes[rec.nodes.index(node)]
        left = max(deadline - time.monotonic(), 1.0)
        req = pb.MigrateRequest(job_id=rec.spec.job_id, node=node, to=to,
                                quiesce_timeout_s=max(left / 4, 1.0))  # fmt: skip
        done = [ev.done for ev in migrate.migrate(c, req) if ev.HasField("done")]
    except errors.SnapshotterError as e:
        rec.life.add("migration_failed", nodes=[node], detail=f"drain of {node}: {e.cause}; "
                     "freezing the job instead")  # fmt: skip
        return None
    detail = (f"ranks moved to {to} (the others stayed in memory; job stalled "
              f"{done[0].stats.downtime_s:.2f}s)")  # fmt: skip
    out = pb.DrainedJob(job_id=rec.spec.job_id, migrated=True, detail=detail)
    out.thawed_on.extend(done[0].nodes)
    rec.life.add("preempted", cause="preempted", nodes=[node],
                 detail=f"drain of {node}: {out.detail}")  # fmt: skip
    return out


def drain_job(c: Coordinator, rec: JobRecord, node: str, grace_s: float) -> pb.DrainedJob:
    job_id = rec.spec.job_id
    deadline = time.monotonic() + grace_s
    moved = _migrated(c, rec, node, deadline)
    if moved is not None:
        return moved
    out = pb.DrainedJob(job_id=job_id)
    done: list[str] = []
    failed: list[BaseException] = []

    def freeze() -> None:
        _await_idle(c, job_id, deadline)  # a policy freeze under way ends first
        left = max(deadline - time.monotonic(), 1.0)
        req = pb.FreezeRequest(job_id=job_id, stop=True, quiesce_timeout_s=max(left / 2, 1.0))
        try:
            for ev in c.freeze(req):
                if ev.HasField("done"):
                    done.append(ev.done.snapshot_id)
        except BaseException as e:  # noqa: BLE001 - reported as the fallback's reason
            failed.append(e)

    t = threading.Thread(target=freeze, daemon=True, name=f"drain-{job_id}")
    t.start()
    t.join(grace_s)
    if done:
        out.snapshot_id = done[0]
        out.detail = f"frozen and stopped as {done[0]}"
    else:
        why = str(failed[0]) if failed else f"the freeze did not finish within {grace_s:.0f}s"
        out.fallback = True
        out.snapshot_id = snapshots.newest(c.store, job_id)
        if out.snapshot_id:
            out.detail = f"{why}; falling back to its newest committed snapshot {out.snapshot_id}"
        else:
            out.detail = f"{why}; the job has no committed snapshot: it is lost with the node"
    rec.life.add("preempted", cause="preempted", snapshot_id=out.snapshot_id,
                 nodes=[node], detail=f"drain of {node}: {out.detail}")  # fmt: skip
    if done and rec.recovers:
        try:
            nodes = recovery_nodes(rec.nodes, [node], c.live_agents(),
                                   list(rec.spec.recovery.spares), c.draining)  # fmt: skip
            for _ in c.thaw(pb.ThawRequest(snapshot_id=done[0], job_id=job_id, nodes=nodes)):
                pass
            out.thawed_on.extend(nodes)
            c.job(job_id).life.add("recovered", cause="preempted", snapshot_id=done[0],
                                   nodes=nodes, detail=f"thawed {done[0]} on {', '.join(nodes)} "
                                   f"(drain of {node})")  # fmt: skip
        except errors.SnapshotterError as e:
            out.detail += f"; the thaw elsewhere failed: {e}"
    return out


def drain_node(c: Coordinator, req: pb.DrainRequest, by_itself: bool = False) -> pb.DrainReply:
    """Every running job on `node` is frozen and stopped within the grace period, or
    falls back to its newest committed snapshot; with --recover auto it is thawed on
    other nodes. Nothing new is placed on the node from now on."""
    node = req.node
    if not c.registered(node):
        raise errors.InvalidArgument(f"no node {node!r} is registered",
                                     "`snapshotter nodes` lists them")  # fmt: skip
    if req.undo:
        c.undrain(node)
        return pb.DrainReply(node=node)
    grace = req.grace_s if req.HasField("grace_s") else 30.0
    if grace <= 0:
        raise errors.InvalidArgument(f"--grace {grace} must be positive", "give seconds > 0")
    c.drain_mark(node, by_itself)
    # A job in a freeze or thaw (a policy snapshot, a recovery) is drained too, once that ends;
    # one the node's agent does not hold (it restarted and forgot it) has nothing there.
    running = [r for r in c.jobs_on(node) if c.phase_of(r) in DRAINED and c.holds(node, r)]
    out = parallel.each(running, lambda r: drain_job(c, r, node, grace),
                        key=lambda r: r.spec.job_id, name="drain")  # fmt: skip
    reply = pb.DrainReply(node=node)
    for r in running:
        j = r.spec.job_id
        if j in out.results:
            reply.jobs.append(out.results[j])
        else:
            reply.jobs.append(pb.DrainedJob(job_id=j, detail=str(out.failures[j])))
    return reply


def drain_self(c: Coordinator, req: pb.DrainRequest) -> pb.DrainReply:
    """An agent drains its own node before it stops; a node certificate drains only
    the node it names."""
    node_caller(req.node, "drain", "an agent drains only its own node")
    if req.undo:
        raise errors.InvalidArgument(
            "an agent cannot undo a drain", "use `snapshotter drain NODE --undo`"
        )
    return drain_node(c, req, by_itself=True)
