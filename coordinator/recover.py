"""Automatic recovery of one failed job (`--recover auto`), run by the supervisor.

    failure    recorded as an event (cause, rank or node, the rank's last traceback)
    limit      K recoveries within the window already: give up, the job is FAILED with it
    stop       whatever is left of the job is ended on every node that answers
    choose     the newest committed snapshot; the job's healthy nodes, lost ones replaced
               by spares or any other healthy agent (decisions.recovery_nodes)
    thaw       under the same job id; the job trains on and `wait` keeps waiting (with no
               snapshot yet, the job is launched again from its start, as torchrun
               --max-restarts would)
    recovered  an event with the snapshot, the steps lost and the time it took

A recovery that fails (no healthy node, a thaw error) is an event too; the job stays
RECOVERING and the supervisor tries again on its next tick, within the same limit.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from snapshotter import errors
from snapshotter.coordinator import detect, snapshots
from snapshotter.coordinator import policy as policies
from snapshotter.coordinator.agents import call_all
from snapshotter.coordinator.decisions import (
    DEFAULT_MAX_TRIES,
    DEFAULT_WINDOW_S,
    may_recover,
    recovery_nodes,
)
from snapshotter.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator, JobRecord

log = logging.getLogger(__name__)
pb = coordinator_pb2
LOG_TAIL_BYTES = 64 * 1024


def recover(c: Coordinator, rec: JobRecord, failure: detect.Failure) -> None:
    life = rec.life
    job_id = rec.spec.job_id
    t0 = time.monotonic()
    first = not life.recovering
    life.recovering = True
    if first:
        c.failures_seen += 1
        if failure.rank is not None:
            life.last_traceback = rank_traceback(c, rec, failure.rank) or life.last_traceback
        nodes = [failure.node] if failure.node else []
        life.add("failure", cause=failure.cause, detail=failure.detail, rank=failure.rank,
                 detect_s=failure.detect_s, nodes=nodes)  # fmt: skip
        log.warning("job %s failed: %s", job_id, failure.detail)
    r = rec.spec.recovery
    max_tries = r.max_tries or DEFAULT_MAX_TRIES
    window = r.window_s or DEFAULT_WINDOW_S
    if not may_recover(life.recoveries, time.time(), max_tries, window):
        give_up(c, rec, f"{failure.detail}; it failed {max_tries} time(s) within "
                        f"{window:.0f}s of a recovery, so it is not recovered again")  # fmt: skip
        return
    t_stop = time.monotonic()
    stop_rest(c, rec)
    stop_s = time.monotonic() - t_stop
    snap = snapshots.newest(c.store, job_id)
    life.recoveries.append(time.time())  # an attempt counts, also one that fails
    try:
        # A node may have died since the failure was seen: ask them all again.
        failed = sorted({*([failure.node] if failure.node else []), *c.unreachable(rec)})
        nodes = recovery_nodes(rec.nodes, failed, c.live_agents(), list(r.spares), c.draining)
        local: list[str] = []
        stats: pb.ThawStats | None = None
        if snap:
            for ev in c.thaw(pb.ThawRequest(snapshot_id=snap, job_id=job_id, nodes=nodes),
                             recovering=True):  # fmt: skip
                if ev.HasField("done"):
                    stats = ev.done.stats
                    local = [n.node for n in stats.nodes if n.local_copy]
        else:
            # Nothing to thaw yet: start it over, as torchrun --max-restarts would.
            c.run(relaunch_request(rec, nodes), recovering=True)
    except errors.SnapshotterError as e:
        life.add("recovery_failed", snapshot_id=snap, detail=str(e))
        log.warning("recovery of job %s from %s failed: %s", job_id, snap or "its start", e)
        return
    now = time.monotonic()
    at_snap = life.snapshot_steps.get(snap) if snap else 0
    lost = None
    if at_snap is not None and life.progress.steps is not None:
        lost = max(life.progress.steps - at_snap, 0)
    life.progress = detect.Progress(steps=at_snap)
    life.policy_state = policies.reanchor(life.policy_state, now, at_snap)
    life.recovering = False
    how = f"thawed {snap}" if snap else "no snapshot yet: relaunched from the start"
    how += f" on {', '.join(nodes)}"
    if local:
        how += f" (from the verified local copy on {', '.join(local)}: nothing fetched)"
    how += "; " + phase_times(stop_s, stats)
    life.add("recovered", cause=failure.cause, snapshot_id=snap, steps_lost=lost,
             took_s=now - t0, nodes=nodes, detail=how)  # fmt: skip
    log.info("job %s recovered from %s on %s in %.1fs", job_id, snap, nodes, now - t0)


def phase_times(stop_s: float, stats: pb.ThawStats | None) -> str:
    """Where a recovery's time went, for its event: ending what was left of the job, then the
    thaw and its phases (the slowest node's; fetch includes checking a local copy; the rest of
    the thaw is mostly the wait for node 0's rendezvous server, 1.3 s of a 2.5 s thaw here,
    unless that agent keeps a standby one: SNAPSHOTTER_RDZV_SPARES).
    `stats` is None for a relaunch from the start."""
    out = f"stop {stop_s:.1f}s"
    if stats is not None:
        restore = max((n.restore_s for n in stats.nodes), default=0.0)
        resume = max((n.resume_s for n in stats.nodes), default=0.0)
        out += (f", thaw {stats.total_s:.1f}s (fetch {stats.fetch_s:.1f}s, restore "
                f"{restore:.1f}s, resume {resume:.1f}s)")  # fmt: skip
    return out


def relaunch_request(rec: JobRecord, nodes: list[str]) -> pb.RunRequest:
    s = rec.spec
    return pb.RunRequest(job_id=s.job_id, script=s.script, script_args=s.script_args,
                         module=s.module, python=s.python, cwd=s.cwd, env=s.env,
                         nnodes=s.nnodes, nproc_per_node=s.nproc_per_node, nodes=nodes,
                         policy=s.policy, recovery=s.recovery)  # fmt: skip


def stop_rest(c: Coordinator, rec: JobRecord) -> None:
    """End what is left of the job on every node that answers (a lost one cannot)."""
    ref = common_pb2.JobRef(job_id=rec.spec.job_id)
    call_all(c.job_handles(rec), "Cancel", ref, 60)


def give_up(c: Coordinator, rec: JobRecord, why: str) -> None:
    life = rec.life
    stop_rest(c, rec)
    tb = life.last_traceback
    life.gave_up = why + (f"\nthe rank's last traceback:\n{tb}" if tb else "")
    life.recovering = False
    life.add("gave_up", detail=life.gave_up)
    log.warning("job %s: recovery stopped: %s", rec.spec.job_id, why)


def rank_traceback(c: Coordinator, rec: JobRecord, rank: int) -> str:
    """The last traceback in the rank's output (empty if its node does not answer)."""
    req = common_pb2.LogsRequest(job_id=rec.spec.job_id, rank=rank)
    tail = b""
    try:
        for chunk in c.logs(req):
            tail = (tail + chunk.data)[-LOG_TAIL_BYTES:]
    except errors.SnapshotterError:
        return ""
    return detect.last_traceback(tail.decode(errors="replace"))
