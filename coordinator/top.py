"""`snapshotter top JOB`: sample every rank of a running job at once (each agent's Progress:
the ranks' step times and collective latencies from their hooks, and the node's view of
their connections), then name what slows or stalls it (top_rules, pure).

Sampling asks each rank over its control channel and reads /proc and the node's TCP stack:
it never stops, signals or slows a rank (agent/progress.py).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from snapshotter import errors
from snapshotter.coordinator import top_rules as rules
from snapshotter.coordinator.agents import AgentHandle, call_all
from snapshotter.coordinator.decisions import JobPhase
from snapshotter.v1 import common_pb2
from snapshotter.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator

MAX_HANG_S = 86400.0


def owners(agents: list[AgentHandle]) -> dict[str, str]:
    """Address -> node, for every address an agent registered with or reported on a link."""
    out: dict[str, str] = {}
    for a in agents:
        if a.host:
            out[a.host] = a.name
        for link in a.links:
            if link.ip:
                out[link.ip] = a.name
    return out


def report(job_id: str, nodes: list[common_pb2.JobProgress], owner: dict[str, str],
           hang_s: float) -> pb.TopReport:  # fmt: skip
    out = pb.TopReport(job_id=job_id, sampled=time.time(), slowest_rank=-1, waits_on=-1)
    if any(p.busy for p in nodes):
        out.busy = True
        out.findings.append("a freeze or thaw holds the job: its ranks were not asked")
        return out
    v = rules.judge(nodes, owner, hang_s)
    out.ranks.extend(
        pb.TopRank(rank=r.rank, node=r.node, answered=r.answered, proc_state=r.proc_state,
                   steps=r.steps, step_s=r.step_s, wait_s=r.wait_s, busy_s=r.busy_s,
                   in_flight_s=r.in_flight_s, last_share=v.late.share.get(r.rank, 0.0))  # fmt: skip
        for r in v.rows
    )
    out.links.extend(
        pb.TopLink(a=x.a, b=x.b, rtt_ms=x.rtt_ms, bytes_sent=x.bytes_sent,
                   bytes_retrans=x.bytes_retrans)  # fmt: skip
        for x in v.links
    )
    out.slowest_rank = -1 if v.slowest_rank is None else v.slowest_rank
    out.slowest_node = v.slowest_node
    out.slowest_link = v.slowest_link
    out.waits_on = -1 if v.waits_on is None else v.waits_on
    out.stalled_s = v.stalled_s
    out.aligned = v.late.aligned
    out.findings.extend(v.findings)
    return out


def _refuse_ended(c: Coordinator, job_id: str) -> None:
    """Raises JobNotRunning when the job has ended: its ranks are gone (or their node forgot
    them), which is no fault of a node's to report as one."""
    state = c.status(job_id).state
    if JobPhase(state).terminal:
        raise errors.JobNotRunning(
            f"job {job_id} has ended ({state}): it has no ranks left to sample",
            f"see `snapshotter status {job_id}` for how it ended and `snapshotter logs {job_id}` "
            "for what its ranks wrote",
        )


def run(c: Coordinator, req: pb.TopRequest) -> pb.TopReport:
    """Raises: JobNotFound; JobNotRunning when the job has ended; InvalidArgument for a bad
    hang threshold; ServiceUnavailable when a node of the job does not answer."""
    if not math.isfinite(req.hang_s) or not 0 <= req.hang_s <= MAX_HANG_S:
        raise errors.InvalidArgument(f"hang threshold {req.hang_s}s is out of range",
                                     f"pass 0 (default {rules.DEFAULT_HANG_S:.0f}s) .. "
                                     f"{MAX_HANG_S:.0f}s")  # fmt: skip
    rec = c.job(req.job_id)
    handles = c.job_handles(rec)
    if not handles:
        raise errors.ServiceUnavailable(f"no node of job {req.job_id} is live",
                                 "see `snapshotter status` for its state")  # fmt: skip
    ref = common_pb2.ProgressRequest(job_id=req.job_id, peers=True)
    out = call_all(handles, "Progress", ref, 10)
    if out.failures or not any(r.answered for p in out.results.values() for r in p.ranks):
        _refuse_ended(c, req.job_id)
    if out.failures:
        node, e = next(iter(out.failures.items()))
        cause = e.cause if isinstance(e, errors.SnapshotterError) else f"{type(e).__name__}: {e}"
        raise errors.ServiceUnavailable(
            f"node {node} did not report job {req.job_id}'s ranks: {cause}",
            "retry; if it persists, see `snapshotter nodes`",
        )
    nodes = []
    for a in handles:
        p = out.results[a.name]
        p.node = p.node or a.name
        nodes.append(p)
    return report(req.job_id, nodes, owners(list(c.live_agents().values())),
                  req.hang_s or rules.DEFAULT_HANG_S)  # fmt: skip
