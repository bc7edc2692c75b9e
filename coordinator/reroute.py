"""Moving a running job's communicators to another data-link plane, every rank in memory.

    bridge    (the job's plane failed) every node routes its peers' addresses on the failed
              plane through their addresses on the new one (agent/links.py), so that the
              collectives in flight on the dead link complete with the values they were
              issued with                                     (failure: nothing to undo)
    quiesce   prepare, park and suspend every rank, as a freeze does (failure: abort, the job
              trains on where it was)
    resume    every rank rebuilds its communicators on the new plane (each node's interface
              of it); the rendezvous store stays on the management address
    unbridge  the routes go: nothing uses the failed plane's addresses any more

Triggered by a node reporting its link down (its heartbeat, at once), by an operator's
`snapshotter link drain NODE IFACE` (no bridge: the link still works), and by `link restore`,
which brings jobs drained off a link back to their home plane. A link that flaps does not
make a job go back and forth: a job stays where it is while its plane works
(decisions.next_plane). When no plane works on every node of the job, nothing can move: the
job is frozen to storage if its ranks can still quiesce (they cannot while a collective is
stuck on the dead link), and otherwise waits for a link with its newest snapshot kept, which
a recovery (`--recover auto`) thaws if the job dies; either way the job's events say so.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from snapshotter import errors, metrics
from snapshotter.coordinator import detect
from snapshotter.coordinator.agents import AgentHandle, call_all, on_all
from snapshotter.coordinator.decisions import (
    JobPhase,
    bridge_routes,
    link_suspect,
    next_plane,
    other_plane,
)
from snapshotter.coordinator.freeze import FreezeOperation, FreezeSettings
from snapshotter.launch.spec import JobSpec
from snapshotter.storage.api import ObjectStore
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator, JobRecord

log = logging.getLogger(__name__)
pb = coordinator_pb2
_RETRY = "the job trains on where it was"
# A collective in flight this long on every rank, with no link down, is taken for a link that
# drops traffic silently (far shorter than gloo's 30 min timeout; SNAPSHOTTER_LINK_DEADLINE_S).
DEFAULT_LINK_DEADLINE_S = 5.0
# After trying another plane for a stuck collective, this long before trying again.
SUSPECT_BACKOFF_S = 60.0
# How long the ranks of a reroute for a stuck collective may take to park: the bridge must
# first let TCP's retransmissions (backed off by then) through.
SUSPECT_QUIESCE_S = 30.0


def links_down_grace() -> float:
    """Seconds no plane may work before a job is frozen for it (SNAPSHOTTER_LINKS_DOWN_GRACE_S,
    default 5): a link that flaps, or whose state comes back a moment late, is not a loss."""
    try:
        v = float(os.environ.get("SNAPSHOTTER_LINKS_DOWN_GRACE_S", "5"))
    except ValueError:
        return 5.0
    return v if v >= 0 else 5.0


def link_deadline() -> float:
    try:
        v = float(os.environ.get("SNAPSHOTTER_LINK_DEADLINE_S", DEFAULT_LINK_DEADLINE_S))
    except ValueError:
        return DEFAULT_LINK_DEADLINE_S
    return v if v > 0 else DEFAULT_LINK_DEADLINE_S


class RerouteOperation(FreezeOperation):
    what = "reroute"
    failed = errors.RerouteFailed
    outcome = "on the plane it had"

    def __init__(
        self,
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        store: ObjectStore,
        settings: FreezeSettings,
        frm: int,
        to: int,
        bridge: bool,
    ) -> None:
        super().__init__(spec, agents, store, False, settings, lambda _: None)
        self.snapshot_id = ""  # nothing is stored
        self.frm, self.to, self.bridge = frm, to, bridge
        self.stall_s = 0.0
        self.bridge_s = 0.0
        self.park_s = 0.0
        self.rebuild_s = 0.0

    def _routes(self) -> dict[str, list[tuple[str, str]]]:
        ips = {a.name: [x.ip for x in a.links] for a in self.agents}
        return {a.name: bridge_routes(ips, a.name, self.frm, self.to) for a in self.agents}

    def _bridge(self, remove: bool) -> None:
        routes = self._routes()

        def one(a: AgentHandle) -> object:
            req = agent_pb2.BridgeRequest(
                plane=self.to, remove=remove,
                routes=[agent_pb2.BridgeRoute(dst=d, via=v) for d, v in routes[a.name]],
            )  # fmt: skip
            return a.stub.Bridge(req, timeout=30)

        out = on_all(self.agents, one)
        if out.failures and not remove:
            name, e = next(iter(out.failures.items()))
            self._bridge(remove=True)
            cause = e.cause if isinstance(e, errors.SnapshotterError) else str(e)
            raise errors.RerouteFailed(
                f"node {name} could not route around its failed link: {cause}", _RETRY
            ) from e
        for name, e in out.failures.items():
            log.warning("node %s kept its bridge routes of job %s: %s", name, self.spec.job_id, e)

    def _run(self) -> Iterator[coordinator_pb2.FreezeEvent]:
        t0 = time.monotonic()
        if self.bridge:
            self._bridge(remove=False)
        self.bridge_s = time.monotonic() - t0
        try:
            yield from self._quiesce()
            self.park_s = self._quiesce_s
            self.plane = self.to
            t_resume = time.monotonic()
            self._resume()
            self.rebuild_s = time.monotonic() - t_resume
            self.stall_s = time.monotonic() - self._t_park
            fin = agent_pb2.FinishFreezeRequest(job_id=self.spec.job_id, freeze_id=self.freeze_id)
            call_all(self.agents, "FinishFreeze", fin, 60)
            self._prepared = []
        finally:
            if self.bridge:
                self._bridge(remove=True)

    def _resume(self) -> None:
        try:
            super()._resume()
        except errors.FreezeFailed as e:
            raise errors.RerouteFailed(
                f"the ranks could not rebuild their communicators on plane {self.to}: "
                f"{e.cause}",
                "cancel the job and thaw its newest snapshot (`snapshotter list --job "
                f"{self.spec.job_id}`)",
            ) from e


def reroute(
    c: Coordinator, rec: JobRecord, to: int, why: str, bridge: bool,
    quiesce_timeout: float = FreezeSettings.quiesce_timeout,
) -> pb.Rerouted:  # fmt: skip
    """Move job `rec` onto plane `to`; the outcome, also as the job's event."""
    frm = rec.plane
    out = pb.Rerouted(job_id=rec.spec.job_id, from_plane=frm, to_plane=to)
    with c.holding(rec, JobPhase.REROUTING):
        handles = c.job_handles(rec)
        if len(handles) != len(rec.agents):
            down = sorted(set(rec.agents) - {a.name for a in handles})
            raise errors.RerouteFailed(
                f"node(s) {', '.join(down)} of job {rec.spec.job_id} do not answer",
                "wait for them to answer again (`snapshotter nodes`)",
            )
        settings = FreezeSettings(quiesce_timeout=quiesce_timeout)
        op = RerouteOperation(rec.spec, handles, c.store, settings, frm, to, bridge)
        op.plane = frm  # a failure resumes the ranks where they were
        try:
            for _ in metrics.observed("reroute", op.run()):
                pass
        except errors.SnapshotterError as e:
            out.error = str(e.cause)
            rec.life.add("reroute_failed", detail=f"plane {frm} -> {to} ({why}): {e.cause}")
            raise
        rec.plane = to
        out.stall_s = op.stall_s
        rec.life.add(
            "rerouted", took_s=op.stall_s, nodes=list(rec.agents),
            detail=f"communicators moved from plane {frm} to plane {to} ({why}); job stalled "
            f"{op.stall_s:.2f}s (park {op.park_s:.2f}s, rebuild {op.rebuild_s:.2f}s; "
            f"bridge routes {op.bridge_s:.2f}s before)",
        )  # fmt: skip
        # It held collectives on purpose: no rank was hung meanwhile.
        rec.life.progress = detect.reset(rec.life.progress, time.monotonic())
    return out


def link(c: Coordinator, req: pb.LinkRequest) -> pb.LinkReply:
    """Drain a node's data link (every job on it moves to another plane) or restore it (jobs
    drained off it come back to their home plane, 0)."""
    a = c.live_agents().get(req.node)
    if a is None:
        raise errors.InvalidArgument(
            f"node {req.node!r} is not registered or its agent does not answer",
            "`snapshotter nodes` lists the live nodes",
        )
    names = [x.name for x in a.links]
    if req.iface not in names:
        raise errors.InvalidArgument(
            f"node {req.node} has no data link {req.iface!r}"
            + (f" (its links: {', '.join(names)})" if names else " (it has none)"),
            "start its agent with --link for each data link; `snapshotter link list`",
        )
    plane = names.index(req.iface)
    reply = pb.LinkReply()
    if req.restore:
        c.drained_links.get(req.node, set()).discard(req.iface)
        for rec in c.unfinished_on(req.node):
            handles = c.job_handles(rec)
            if rec.plane != 0 and c.plane_for(handles, current=0) == 0:
                reply.jobs.append(_try(c, rec, 0, f"link {req.iface} of {req.node} restored",
                                       bridge=False))  # fmt: skip
        return reply
    moving = [r for r in c.unfinished_on(req.node) if r.plane == plane]
    drained = {*c.drained_links.get(req.node, set()), req.iface}
    stuck = []
    for rec in moving:
        usable = [c.link_usable(h) for h in c.job_handles(rec)]
        i = rec.agents.index(req.node) if req.node in rec.agents else -1
        if 0 <= i < len(usable) and plane < len(usable[i]):
            usable[i][plane] = False
        if next_plane(rec.plane, usable) is None:
            stuck.append(rec.spec.job_id)
    if stuck:
        raise errors.InvalidArgument(
            f"no other healthy link for job(s) {', '.join(stuck)}: draining {req.iface} of "
            f"{req.node} would leave them without a network",
            "bring another link of theirs up first (`snapshotter link list`)",
        )
    c.drained_links[req.node] = drained
    for rec in moving:
        to = c.plane_for(c.job_handles(rec), current=rec.plane)
        reply.jobs.append(_try(c, rec, to, f"link {req.iface} of {req.node} drained",
                               bridge=False))  # fmt: skip
    return reply


def _try(c: Coordinator, rec: JobRecord, to: int, why: str, bridge: bool) -> pb.Rerouted:
    try:
        return reroute(c, rec, to, why, bridge)
    except errors.SnapshotterError as e:
        return pb.Rerouted(job_id=rec.spec.job_id, from_plane=rec.plane, to_plane=to,
                           error=str(e))  # fmt: skip


def _linked(c: Coordinator, rec: JobRecord) -> list[AgentHandle] | None:
    """The job's agents, when all answer and some have data links to move between."""
    handles = c.job_handles(rec)
    if len(handles) != len(rec.agents) or all(not h.links for h in handles):
        return None
    return handles


def needs_move(c: Coordinator, rec: JobRecord, now: float) -> bool:
    """Whether a job's plane no longer works on all its nodes (from the last heartbeats:
    no call to any agent), or no plane has worked for LINKS_DOWN_GRACE_S and that was not
    reported yet (a link coming back meanwhile, or reporting itself back late, moves the
    job instead of stopping it)."""
    handles = _linked(c, rec)
    if handles is None:
        return False
    to = next_plane(rec.plane, [c.link_usable(h) for h in handles])
    if to is not None:
        rec.life.links_down = False
        rec.life.links_down_since = None
        return to != rec.plane
    if rec.life.links_down_since is None:
        rec.life.links_down_since = now
    return not rec.life.links_down and now - rec.life.links_down_since >= links_down_grace()


def check_links(c: Coordinator, rec: JobRecord) -> None:
    """The supervisor's look at one running job's links: move it when its plane failed;
    when none works, freeze it to storage if it can still quiesce, else report."""
    handles = _linked(c, rec)
    if handles is None:
        return
    usable = [c.link_usable(h) for h in handles]
    to = next_plane(rec.plane, usable)
    if to == rec.plane:
        rec.life.links_down = False
        return
    down = [f"{h.name}:{x.name}" for h in handles for x in h.links if not x.up]
    if to is not None:
        why = f"link(s) {', '.join(down)} down" if down else "its link was drained"
        _try(c, rec, to, why, bridge=bool(down))
        return
    if rec.life.links_down:
        return  # reported once; a link coming back makes the job go on by itself
    rec.life.links_down = True
    newest = rec.snapshots[-1] if rec.snapshots else ""
    rec.life.add("links_down", detail=f"no data link works on every node of the job "
                 f"({', '.join(down)}); trying to freeze it to storage")  # fmt: skip
    try:
        for ev in c.freeze(pb.FreezeRequest(job_id=rec.spec.job_id, stop=True,
                                            quiesce_timeout_s=10.0)):  # fmt: skip
            if ev.HasField("done"):
                rec.life.add("links_down", snapshot_id=ev.done.snapshot_id,
                             detail=f"frozen to storage as {ev.done.snapshot_id}; thaw it "
                             "when a link is back")  # fmt: skip
    except errors.SnapshotterError as e:
        rec.life.add("links_down", snapshot_id=newest,
                     detail=f"could not freeze it ({e.cause}); it waits for a link to come "
                     f"back, newest snapshot {newest or 'none'} kept")  # fmt: skip


def suspect(c: Coordinator, rec: JobRecord, now: float) -> tuple[int, int, float] | None:
    """(the plane to try, the rank waiting longest, how long) when every rank of a job has
    had a collective in flight past the link deadline (a link that drops traffic without
    going down), or None. Asks the ranks (a progress sample) only for a job that has another
    plane to go to."""
    handles = _linked(c, rec)
    if handles is None:
        return None
    last = rec.life.link_suspected_at
    if last is not None and now - last < SUSPECT_BACKOFF_S:
        return None
    to = other_plane(rec.plane, [c.link_usable(h) for h in handles])
    if to is None:
        return None
    ref = common_pb2.ProgressRequest(job_id=rec.spec.job_id)
    out = call_all(handles, "Progress", ref, 5)
    if out.failures or any(p.busy for p in out.results.values()):
        return None
    ranks = [r for p in out.results.values() for r in p.ranks if not r.HasField("exit_code")]
    if not ranks or not all(r.answered for r in ranks):
        return None
    found = link_suspect({r.rank: r.in_flight_s for r in ranks}, link_deadline())
    if found is None:
        return None
    rec.life.link_suspected_at = now
    return (to, *found)


def reroute_suspect(c: Coordinator, rec: JobRecord, to: int, rank: int, waited: float) -> None:
    """Try plane `to` for a job whose collectives are stuck (rank `rank` for `waited`
    seconds), bridging its current plane: if a link drops their traffic, the collectives
    complete and the job moves; if a rank hangs instead, it cannot park, and the job is left
    as it was (hang detection's to handle)."""
    why = (f"every rank had a collective in flight past the {link_deadline():.0f}s link "
           f"deadline (rank {rank}: {waited:.1f}s) with no link down: a link may drop "
           "traffic")
    try:
        reroute(c, rec, to, why, bridge=True, quiesce_timeout=SUSPECT_QUIESCE_S)
    except errors.SnapshotterError as e:
        log.warning("job %s: trying plane %d for its stuck collectives: %s", rec.spec.job_id,
                    to, e)  # fmt: skip
