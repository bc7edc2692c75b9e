"""Sampling a job's training progress on this node without disturbing its ranks.

Every live rank is asked at once over its control channel (`progress` in
snapshotter/hook/protocol.py) and given one short shared deadline. A rank that does not answer
in time is reported as such, with its process state from /proc: 'T' (stopped) or 'Z' tells a
frozen or dead process from one whose control thread is merely slow, and the ranks that did
answer show whether their counts still advance.

The sample takes the job's `op_lock` without waiting: while a freeze or thaw holds it, that
operation owns the ranks' control channels (and a rank suspending or rebuilding its
communicators answers nothing until it is done), so the job is reported busy and no rank is
asked. A sample holds the lock for at most `TIMEOUT_S` and a little, which is what a freeze's
Prepare waits for it (`HOLD_S`).

This module never signals, stops or waits on a rank; it only sends a query and reads /proc.
"""

from __future__ import annotations

import time

from snapshotter import errors
from snapshotter.agent import peers as connections
from snapshotter.agent.rankctl import progress_all
from snapshotter.agent.runtime import NodeJob, RankRuntime
from snapshotter.procutil import first_child, proc_state
from snapshotter.v1 import common_pb2

# How long the ranks of one sample have to answer, together. A rank's control thread answers
# in microseconds; one that needs a second is stopped, dead or starved.
TIMEOUT_S = 1.0
# The longest a sample holds a job's op_lock: its deadline and the sends before it.
HOLD_S = TIMEOUT_S + 0.5


def rank_state(r: RankRuntime) -> str:
    """The /proc state of the rank's own process (the sandbox init's first child), or of the
    init when the rank is gone; "" once both are."""
    if r.exit_code is not None:
        return proc_state(r.sandbox.pid)  # "" once reaped
    pid = first_child(r.sandbox.pid)
    return proc_state(pid if pid is not None else r.sandbox.pid)


def _unanswered(r: RankRuntime) -> common_pb2.RankProgress:
    m = common_pb2.RankProgress(rank=r.rank, answered=False, proc_state=rank_state(r))
    if r.exit_code is not None:
        m.exit_code = r.exit_code
    return m


def sample(job: NodeJob, timeout: float = TIMEOUT_S, peers: bool = False,
           conns: list[connections.Conn] | None = None) -> common_pb2.JobProgress:  # fmt: skip
    """Every rank's progress on this node, or `busy` when a freeze or thaw holds the job;
    with `peers`, also its ranks' connections to other nodes (agent/peers.py), from `conns`
    when given (the node's connections, read once for all its jobs).

    Raises:
        InvalidArgument: `timeout` is not in (0, TIMEOUT_S]: a longer sample would hold up
            a freeze that waits for it.
    """
    if not 0 < timeout <= TIMEOUT_S:
        raise errors.InvalidArgument(
            f"progress timeout {timeout}s is not in (0, {TIMEOUT_S}]",
            f"pass a timeout of at most {TIMEOUT_S}s; sample again for a longer view",
        )
    reply = common_pb2.JobProgress(job_id=job.spec.job_id, sampled=time.time())
    if not job.op_lock.acquire(blocking=False):
        reply.busy = True
        reply.ranks.extend(_unanswered(r) for r in sorted(job.ranks, key=lambda r: r.rank))
        return reply
    try:
        # A rank whose channel closed (it is ending) is reported unanswered.
        answers = progress_all({r.rank: r.channel for r in job.alive_ranks()}, timeout)
    finally:
        job.op_lock.release()
    for r in sorted(job.ranks, key=lambda r: r.rank):
        p = answers.get(r.rank)
        if p is None:
            reply.ranks.append(_unanswered(r))
            continue
        reply.ranks.append(
            common_pb2.RankProgress(
                rank=r.rank,
                answered=True,
                steps=p.steps,
                counts=p.counts,
                proc_state=rank_state(r),
                in_flight_s=p.in_flight_s,
                step_s=p.step_s,
                steps_window=p.steps_window,
                timings=[
                    common_pb2.CollectiveTiming(group=k, done=t.done, window=t.window,
                                                mean_s=t.mean_s, p50_s=t.p50_s,
                                                seqs=[q for q, _ in t.recent],
                                                latencies_s=[v for _, v in t.recent])  # fmt: skip
                    for k, t in sorted(p.timings.items())
                ],
            )
        )
    if not peers:
        return reply
    pids = {pid for r in job.alive_ranks() if (pid := first_child(r.sandbox.pid)) is not None}
    reply.peers.extend(
        common_pb2.PeerStats(address=p.address, connections=p.connections, rtt_ms=p.rtt_ms,
                             bytes_sent=p.bytes_sent, bytes_retrans=p.bytes_retrans,
                             delivery_bps=p.delivery_bps)  # fmt: skip
        for p in connections.collect(pids, conns)
    )
    return reply
