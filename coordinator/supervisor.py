"""Keeps jobs running by themselves: policy snapshots, failure detection and recovery.

One thread wakes every `tick_s` and looks at each job that has a snapshot policy or
`--recover auto`. Per job, in this order:

    busy       a freeze, thaw or our own worker holds the job: only its progress clock resets
    failure    a rank failed, a node was lost, or the job hangs (detect.py): with --recover
               auto, a recovery worker starts (recover.py)
    policy     the next snapshot is due (policy.py): a freeze-and-continue worker starts,
               then retention expires what the policy no longer keeps

Decisions are the pure functions of policy.py, detect.py and decisions.py; this module only
samples (agents' Status and Progress) and starts work, at most one worker per job at a time.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING

from snapshotter import errors, metrics
from snapshotter.config import gc_interval
from snapshotter.coordinator import detect, gc, recover, reroute, snapshots
from snapshotter.coordinator import policy as policies
from snapshotter.coordinator.agents import call_all
from snapshotter.coordinator.decisions import DEFAULT_HANG_DEADLINE_S, JobPhase
from snapshotter.rpc import convert
from snapshotter.v1 import common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator, JobRecord

log = logging.getLogger(__name__)
pb = coordinator_pb2
# Every live rank's hook answers `prepare` at once from its control thread (also while its
# training thread waits in a collective); one that does not within this is stopped or hung,
# and the policy's freeze gives up soon, so that hang detection can look again.
POLICY_PREPARE_TIMEOUT_S = 5.0
# How long a policy freeze waits for every rank to park, at most: a person's freeze waits
# longer (a long phase without collectives), a policy's retries at its next due time.
POLICY_QUIESCE_TIMEOUT_S = 60.0


def policy_quiesce_timeout(recovers: bool, hang_deadline_s: float) -> float:
    """A rank that does not reach the next collective within the hang deadline is hung (or
    stopped): under --recover auto a policy freeze gives up on it by then, so that hang
    detection, which a freeze holds off, names it within its deadline, not the park's."""
    if not recovers:
        return POLICY_QUIESCE_TIMEOUT_S
    return max(1.0, min(POLICY_QUIESCE_TIMEOUT_S, hang_deadline_s))


def hang_deadline(rec: JobRecord) -> float:
    return rec.spec.recovery.hang_deadline_s or DEFAULT_HANG_DEADLINE_S


def policy_of(rec: JobRecord) -> policies.Policy:
    return policies.Policy.from_dict(convert.plain(rec.spec.policy))


class Supervisor:
    def __init__(
        self, c: Coordinator, tick_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.c = c
        self.tick_s = tick_s
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # When the last sweep of shared chunks started: the first comes an interval after
        # start, not during it (it lists every chunk and reads every manifest).
        self._swept = clock()
        self._sweeping = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="supervisor")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.c.links_changed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            self.c.keep_lives()  # what changed since the last tick, for the next coordinator
        except Exception:  # noqa: BLE001 - stopping must not fail on the store
            log.exception("could not keep the jobs' events at stop")

    def _loop(self) -> None:
        while not self._stop.is_set():
            # A node reporting a link change wakes the loop at once (a reroute's clock).
            self.c.links_changed.wait(self.tick_s)
            self.c.links_changed.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad tick
                log.exception("supervisor tick failed")

    def tick(self) -> None:
        self.c.keep_lives()  # first: what follows may wait on slow agents
        for rec in self.c.unfinished():
            if rec.busy is not None or rec.life.busy():
                continue
            if reroute.needs_move(self.c, rec, self.clock()):
                self._start(rec, "reroute", functools.partial(reroute.check_links, self.c, rec))
                continue
            found = reroute.suspect(self.c, rec, self.clock())
            if found is not None:
                self._start(rec, "reroute", functools.partial(reroute.reroute_suspect, self.c,
                                                              rec, *found))  # fmt: skip
        for rec in self.c.supervised():
            try:
                self._job(rec)
            except errors.SnapshotterError as e:
                log.warning("supervising job %s: %s", rec.spec.job_id, e)
        self.c.keep_lives()
        self._maybe_sweep()

    # ---- shared chunks ---------------------------------------------------------------------

    def _maybe_sweep(self) -> None:
        """Every SNAPSHOTTER_GC_INTERVAL_S, sweep the shared chunks that no committed snapshot
        lists any more (retention only deletes manifests), in the background, while no freeze
        of this coordinator writes."""
        interval = gc_interval()
        now = self.clock()
        if interval <= 0 or self._sweeping or now - self._swept < interval or self.c.protected():
            return
        self._swept, self._sweeping = now, True
        threading.Thread(target=self._sweep, daemon=True, name="chunk-sweep").start()

    def _sweep(self) -> None:
        try:
            r = gc.sweep_chunks(self.c.store, lambda: bool(self.c.protected()), now=time.time(),
                                min_age_s=gc.DEFAULT_MIN_AGE_S, delete=True)  # fmt: skip
            if r["collected"] or r["failed"]:
                log.info("swept %d shared chunk(s) (%d bytes) no snapshot lists; %d failed",
                         r["collected"], r["collected_bytes"], r["failed"])  # fmt: skip
        except errors.SnapshotterError as e:
            log.warning("sweep of shared chunks: %s", e)
        finally:
            self._sweeping = False

    # ---- one job ---------------------------------------------------------------------------

    def _job(self, rec: JobRecord) -> None:
        life = rec.life
        now = self.clock()
        if life.busy() or rec.busy is not None:
            return  # a freeze or thaw resets the progress clocks when it succeeds
        views = self.c.node_views(rec)
        phase = self.c.phase_of(rec, views)
        failure: detect.Failure | None = None
        if phase is JobPhase.RECOVERING or phase is JobPhase.RUNNING:
            codes = {r.rank: (r.exit_code if r.HasField("exit_code") else None)
                     for v in views for r in v.ranks}  # fmt: skip
            first = [r.rank for v in views for r in v.ranks if r.failed_first]
            failure = detect.rank_failure(codes, first)
            lost = detect.lost_nodes(rec.agents, self.c.live_agents())
            why = f"no heartbeat for {self.c.agent_ttl:.0f}s"
            if not lost and failure is not None:
                # Ranks failed: because their node died (its peers' connections reset first)?
                lost, why = self.c.unreachable(rec), "its agent does not answer"
            if lost:
                failure = detect.Failure(
                    "node_lost", f"node {lost[0]} is lost ({why})", node=lost[0],
                    detect_s=self.c.heartbeat_age(lost[0]),
                )  # fmt: skip
            if failure is None:
                failure = detect.gpu_failure({v.node: list(v.gpu_faults) for v in views if v.node})
            if failure is None and phase is JobPhase.RECOVERING and not life.recovering:
                failure = detect.Failure("rank_exit", "the job's ranks failed")
        if failure is None and phase is JobPhase.RUNNING:
            failure = self._sample(rec, now)
        if failure is not None:
            if rec.recovers and not life.gave_up and not life.cancelled:
                self._start(rec, "recover", lambda: recover.recover(self.c, rec, failure))
            return
        if phase is not JobPhase.RUNNING:
            return
        pol = policy_of(rec)
        if not pol.active or set(rec.agents) & self.c.draining:
            return  # a node of the job is being drained: its drain freezes it
        interval = self._interval(rec, pol)
        steps = life.progress.steps
        life.policy_state = policies.normalize(life.policy_state, now, steps)
        if not policies.decide(pol, life.policy_state, now, steps, interval,
                               measured=bool(life.stalls)).due:  # fmt: skip
            return
        stalled = detect.stalled_for(life.progress, now)
        deadline = hang_deadline(rec)
        if rec.recovers and stalled is not None and stalled >= min(deadline / 2, 60.0):
            # It may be hanging: a freeze would wait on it and hide the hang; let detection
            # decide first.
            return
        metrics.POLICY_LAG.observe(policies.lag_s(life.policy_state, now, interval))
        self._start(rec, "snapshot", lambda: self._snapshot(rec, pol))

    def _sample(self, rec: JobRecord, now: float) -> detect.Failure | None:
        """Sample every rank's progress (for the step rule and hang detection)."""
        pol = policy_of(rec)
        if pol.every_steps is None and not pol.auto and not rec.recovers:
            return None
        ref = common_pb2.ProgressRequest(job_id=rec.spec.job_id)
        out = call_all(self.c.job_handles(rec), "Progress", ref, 5)
        if out.failures or any(p.busy for p in out.results.values()):
            return None
        samples = [
            detect.RankSample(rank=r.rank, answered=r.answered, counts=dict(r.counts),
                              steps=r.steps, proc_state=r.proc_state)
            for p in out.results.values() for r in p.ranks if not r.HasField("exit_code")
        ]  # fmt: skip
        rec.life.progress = detect.observe(rec.life.progress, samples, now)
        if not rec.recovers:
            return None
        return detect.hang(rec.life.progress, samples, now, hang_deadline(rec))

    def _interval(self, rec: JobRecord, pol: policies.Policy) -> float | None:
        if not pol.auto:
            return pol.every_s
        return self.c.auto_inputs(rec).interval_s

    def _start(self, rec: JobRecord, what: str, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - reported as the job's event, never lost
                log.exception("%s of job %s failed", what, rec.spec.job_id)

        t = threading.Thread(target=run, daemon=True, name=f"{what}-{rec.spec.job_id}")
        rec.life.worker = t
        t.start()

    # ---- policy snapshots ------------------------------------------------------------------

    def _snapshot(self, rec: JobRecord, pol: policies.Policy) -> None:
        life = rec.life
        steps = life.progress.steps
        life.policy_state = policies.started(life.policy_state, self.clock(), steps)
        t0 = time.monotonic()
        try:
            done = None
            park_s = policy_quiesce_timeout(rec.recovers, hang_deadline(rec))
            req = pb.FreezeRequest(job_id=rec.spec.job_id, quiesce_timeout_s=park_s)
            for ev in self.c.freeze(req, prepare_timeout=POLICY_PREPARE_TIMEOUT_S):
                if ev.HasField("done"):
                    done = ev.done
        except errors.SnapshotterError as e:
            life.policy_state = policies.finished(
                life.policy_state, self.clock(), steps, ok=False, error=e.cause
            )
            life.add("snapshot_failed", detail=str(e))
            return
        # The interval counts from the commit, not from the resume: the upload that follows a
        # resume slows the job too (on a 2-core node, compressing 1.4 GB ran beside the ranks
        # for 5-10 s), and the cost Young–Daly is given is the stall alone. Counted from the
        # resume, the goodput bench lost 0.221 instead of 0.141 (snapshots back to back).
        life.policy_state = policies.finished(life.policy_state, self.clock(), steps, ok=True)
        assert done is not None
        stall = done.stats.stall_s if done.stats.HasField("stall_s") else 0.0
        life.add("snapshot", snapshot_id=done.snapshot_id, took_s=time.monotonic() - t0,
                 detail=f"policy ({pol.describe()}); the job stalled {stall:.2f}s")  # fmt: skip
        self.expire(rec, pol)

    def expire(self, rec: JobRecord, pol: policies.Policy) -> list[str]:
        """Delete the job's committed snapshots its policy no longer keeps (never one a thaw
        reads or a freeze writes, never the newest)."""
        listed = snapshots.list_snapshots(self.c.store, rec.spec.job_id).snapshots
        protected = self.c.protected()
        gone = policies.to_expire(
            [(s.snapshot_id, s.created) for s in listed], pol, time.time(), protected
        )
        deleted = []
        for sid in gone:
            try:
                snapshots.delete(self.c.store, sid)
            except errors.SnapshotterError as e:
                log.warning("could not expire snapshot %s: %s", sid, e)
                continue
            deleted.append(sid)
            if sid in rec.snapshots:
                rec.snapshots.remove(sid)
        if deleted:
            rec.life.add("expired", detail=f"retention ({pol.describe()}): {', '.join(deleted)}")
        return deleted


# ---- the policy's RPCs -------------------------------------------------------------------


def set_policy(c: Coordinator, req: pb.SetPolicyRequest) -> pb.PolicyInfo:
    """`policy set|clear`: only the fields given change; the interval counts from now."""
    rec = c.job(req.job_id)
    if req.clear:
        new = policies.Policy()
    else:
        old = policies.Policy.from_dict(convert.plain(rec.spec.policy))
        given = req.policy
        new = policies.merge(
            old,
            every_s=given.every_s if given.HasField("every_s") else None,
            auto=given.auto if req.every_given else None,
            every_steps=given.every_steps if given.HasField("every_steps") else None,
            keep=given.keep if given.HasField("keep") else None,
            keep_hourly_days=given.keep_hourly_days
            if given.HasField("keep_hourly_days") else None,
            keep_daily_days=given.keep_daily_days
            if given.HasField("keep_daily_days") else None,
        )  # fmt: skip
    policies.check(new)
    rec.spec = rec.spec.with_policy(convert.parse(new.to_dict(), common_pb2.Policy))
    rec.life.policy_state = policies.reanchor(
        rec.life.policy_state, time.monotonic(), rec.life.progress.steps
    )
    missed = c.share_policy(rec)
    note = f" (not kept on node(s) {', '.join(missed)}: they did not answer)" if missed else ""
    rec.life.add("policy", detail=new.describe() + note)
    # Kept at once, not at the next tick: an operator's change must outlive a coordinator
    # killed right after it (the tick may be slow while agents are busy freezing).
    c.journal.save_changed([(req.job_id, rec.life)])
    return show_policy(c, req.job_id)


def show_policy(c: Coordinator, job_id: str) -> pb.PolicyInfo:
    """`policy show`: the policy, the inputs of its interval, and why it is due or not."""
    rec = c.job(job_id)
    pol = policies.Policy.from_dict(convert.plain(rec.spec.policy))
    life = rec.life
    info = pb.PolicyInfo(job_id=job_id, policy=rec.spec.policy, describe=pol.describe(),
                         failures=life.policy_state.failures,
                         last_error=life.policy_state.last_error)  # fmt: skip
    interval = pol.every_s
    if pol.auto:
        auto = c.auto_inputs(rec)
        interval = auto.interval_s
        info.auto.CopyFrom(convert.parse(asdict(auto), pb.AutoInterval))
    if interval is not None:
        info.interval_s = interval
    steps = life.progress.steps
    if steps is not None:
        info.steps = steps
    if life.policy_state.anchor_steps is not None:
        info.anchor_steps = life.policy_state.anchor_steps
    now = time.monotonic()
    state = policies.normalize(life.policy_state, now, steps)
    due = policies.decide(pol, state, now, steps, interval, measured=bool(life.stalls))
    info.state = due.reason
    if due.wait_s is not None:
        info.next_in_s = due.wait_s
    return info
