"""Per-job snapshot policies: when the next periodic snapshot is due, and what retention deletes.

This is the pure decision layer. The coordinator's policy thread calls it about once a second
with `time.monotonic()` as `now` (and `time.time()` where a wall clock is named), keeps one
`PolicyState` per job and replaces it with what `started`, `finished`, `reanchor` and
`normalize` return. This module must never do I/O, read a clock, or start a freeze itself.

One tick of the caller, for one job:

    s = normalize(s, now, steps)                 # fold clock/step-counter jumps into the state
    d = decide(policy, s, now, steps, interval)  # every_s, or auto_interval(...).interval_s
    if d.due:
        s = started(s, now, steps)               # then freeze; when it ends:
        s = finished(s, end, steps, ok, error)

The interval counts from the end of the last successful policy freeze, never from when the
previous one was due: a freeze that overran, a suspended coordinator or a clock that jumped
forward yields one snapshot, never a burst of catch-ups.
"""

from __future__ import annotations

import enum
import math
import re
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from snapshotter import errors

MIN_INTERVAL_S = 5.0
# Past a day, the next node failure, not the interval, bounds the work lost; a day also keeps a
# job that never fails from going unsnapshotted for its whole life.
MAX_AUTO_INTERVAL_S = 24 * 3600.0
# 30 days per node, on purpose pessimistic. Llama 3's 405B run (Meta, 2024) saw 419 unexpected
# interruptions in 54 days on 2,048 eight-GPU servers: one per ~260 node-days. Smaller or newer
# clusters, and jobs that also count software faults, fail far more often. A pessimistic prior
# errs towards a few extra freezes; an optimistic one towards lost work. It weighs as one failure,
# so a cluster's own observations take over quickly.
DEFAULT_PRIOR_NODE_MTBF_S = 30 * 24 * 3600.0
# A freeze measured at zero (or not at all) would make Young–Daly snapshot constantly.
MIN_COST_S = 0.5
DEFAULT_FREEZE_COST_S = 10.0
# Enough recent freezes that one slow store upload does not swing the interval, few enough that
# a job whose state grew is re-measured within hours.
FREEZE_COST_WINDOW = 10
# A refused or failed policy freeze is retried after 10 s, 20 s, 40 s, ... up to the interval.
BACKOFF_BASE_S = 10.0
# The cap on that backoff for a policy with no time rule (steps only).
STEP_ONLY_BACKOFF_CAP_S = 60.0

_T = TypeVar("_T")
_EVERY_FORMS = "a duration such as 30s, 10m, 1h, 1.5h or 90 (seconds), auto, or off"
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(?P<n>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[smh]?)$")


class Clear(enum.Enum):
    """`merge(old, keep=CLEAR)`: remove a setting (None already means "leave it as it is")."""

    CLEAR = "off"


CLEAR = Clear.CLEAR


@dataclass(frozen=True)
class Policy:
    """A job's snapshot policy, as `run`/`policy set` flags give it. Valid when `check` passes."""

    every_s: float | None = None  # --snapshot-every 30s|10m|1h|90
    auto: bool = False  # --snapshot-every auto: the Young–Daly interval
    every_steps: int | None = None  # --snapshot-every-steps N (optimizer steps)
    keep: int | None = None  # --keep K: the newest K committed snapshots; None keeps all
    keep_hourly_days: float | None = None  # --keep-hourly D: also one per UTC hour for D days
    keep_daily_days: float | None = None  # --keep-daily D: also one per UTC day for D days

    @property
    def active(self) -> bool:
        """Whether the policy takes snapshots at all (retention alone applies to manual ones)."""
        return self.timed or self.every_steps is not None

    @property
    def timed(self) -> bool:
        return self.every_s is not None or self.auto

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        """The policy `to_dict` wrote. Missing keys take their defaults and unknown ones are
        dropped, so a coordinator can restore jobs saved by an older or newer version.

        Raises:
            InvalidArgument: a field of the wrong type, or a policy `check` rejects.
        """

        def get(key: str, kinds: tuple[type, ...]) -> Any:
            v = d.get(key)
            # bool is an int to isinstance; a stored `true` is never a count or a duration.
            wrong_bool = isinstance(v, bool) and bool not in kinds
            if v is not None and (not isinstance(v, kinds) or wrong_bool):
                raise errors.InvalidArgument(
                    f"stored snapshot policy has {key}={v!r}",
                    "set the job's policy again with `snapshotter policy set`",
                )
            return v

        every_s = get("every_s", (int, float))
        days_h = get("keep_hourly_days", (int, float))
        days_d = get("keep_daily_days", (int, float))
        p = cls(
            every_s=None if every_s is None else float(every_s),
            auto=bool(get("auto", (bool,))),
            every_steps=get("every_steps", (int,)),
            keep=get("keep", (int,)),
            keep_hourly_days=None if days_h is None else float(days_h),
            keep_daily_days=None if days_d is None else float(days_d),
        )
        check(p)
        return p

    def describe(self) -> str:
        """One line for `policy show` and `jobs`, e.g. "every 10m, keep 3"."""
        parts: list[str] = []
        if self.auto:
            parts.append("auto (Young–Daly)")
        elif self.every_s is not None:
            parts.append(f"every {format_duration(self.every_s)}")
        if self.every_steps is not None:
            parts.append(f"every {self.every_steps} steps")
        if not parts:
            if self.keep is None and not self.keep_hourly_days and not self.keep_daily_days:
                return "off"
            parts.append("no periodic snapshots")
        parts.append("keep all" if self.keep is None else f"keep {self.keep}")
        if self.keep_hourly_days:
            parts.append(f"hourly for {_days(self.keep_hourly_days)}")
        if self.keep_daily_days:
            parts.append(f"daily for {_days(self.keep_daily_days)}")
        return ", ".join(parts)


def format_duration(seconds: float) -> str:
    """The largest unit that says it in at most one decimal ("10m", "1.5h", "90s" as "1.5m"),
    else whole seconds ("849s"): parse_every reads it back, to the second."""
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        n = seconds / size
        if n >= 1 and abs(round(n, 1) * size - seconds) < 1e-6:
            return f"{round(n, 1):g}{unit}"
    return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.2g}s"


def _days(d: float) -> str:
    return f"{d:g} day" + ("" if d == 1 else "s")


def parse_every(text: str) -> tuple[float | None, bool]:
    """`--snapshot-every`: "30s" "10m" "1h" "1.5h" "90" -> (seconds, False); "auto" ->
    (None, True); "off" or "" -> (None, False).

    Raises:
        InvalidArgument: any other form, zero, or an interval under MIN_INTERVAL_S.
    """
    t = text.strip().lower()
    if t in ("", "off"):
        return None, False
    if t == "auto":
        return None, True
    m = _DURATION.match(t)
    if m is None:
        raise errors.InvalidArgument(
            f"--snapshot-every {text!r} is not a duration", f"pass {_EVERY_FORMS}"
        )
    seconds = float(m["n"]) * _UNIT_S[m["unit"]]
    if seconds < MIN_INTERVAL_S:
        # Every freeze stalls the job; below a few seconds it would do little else.
        raise errors.InvalidArgument(
            f"--snapshot-every {text!r} is under the minimum of {MIN_INTERVAL_S:g}s",
            f"pass {_EVERY_FORMS}; at least {MIN_INTERVAL_S:g}s",
        )
    return seconds, False


def check(p: Policy) -> None:
    """Reject a policy that contradicts itself or cannot be followed.

    Raises:
        InvalidArgument: a fixed interval together with auto, an interval under
            MIN_INTERVAL_S, keep or every_steps under 1, negative or non-finite days.
    """
    if p.every_s is not None and p.auto:
        raise errors.InvalidArgument(
            "--snapshot-every cannot be both a fixed interval and auto",
            "pass either a duration (e.g. 10m) or auto",
        )
    if p.every_s is not None and not (math.isfinite(p.every_s) and p.every_s >= MIN_INTERVAL_S):
        raise errors.InvalidArgument(
            f"--snapshot-every {p.every_s!r}s is not an interval of at least {MIN_INTERVAL_S:g}s",
            f"pass {_EVERY_FORMS}",
        )
    if p.every_steps is not None and p.every_steps < 1:
        raise errors.InvalidArgument(
            f"--snapshot-every-steps {p.every_steps} is under 1",
            "pass a number of optimizer steps of 1 or more, or leave it out",
        )
    if p.keep is not None and p.keep < 1:
        raise errors.InvalidArgument(
            f"--keep {p.keep} is under 1: the newest snapshot is never deleted",
            "pass --keep 1 or more, or leave it out to keep every snapshot",
        )
    for flag, days in (("--keep-hourly", p.keep_hourly_days), ("--keep-daily", p.keep_daily_days)):
        if days is not None and not (math.isfinite(days) and days >= 0):
            raise errors.InvalidArgument(
                f"{flag} {days!r} is not a non-negative number of days",
                f"pass {flag} DAYS (e.g. 2 or 0.5), or leave it out",
            )


def merge(
    old: Policy,
    *,
    every_s: float | None = None,
    auto: bool | None = None,
    every_steps: int | Clear | None = None,
    keep: int | Clear | None = None,
    keep_hourly_days: float | Clear | None = None,
    keep_daily_days: float | Clear | None = None,
) -> Policy:
    """`policy set`: `old` with only the flags given changed (None leaves a field as it was,
    CLEAR removes it).

    `every_s` and `auto` are one flag, --snapshot-every: giving either replaces both, so pass
    them as parse_every returns them. "auto" drops a fixed interval, "10m" drops auto, and "off"
    (None, False) turns the time rule off.

    Raises:
        InvalidArgument: the merged policy fails `check`.
    """
    p = old
    if every_s is not None or auto is not None:
        # Both given as a duration and auto stays a contradiction for check() to name.
        p = replace(p, every_s=every_s, auto=bool(auto))
    p = replace(
        p,
        every_steps=_pick(every_steps, p.every_steps),
        keep=_pick(keep, p.keep),
        keep_hourly_days=_pick(keep_hourly_days, p.keep_hourly_days),
        keep_daily_days=_pick(keep_daily_days, p.keep_daily_days),
    )
    check(p)
    return p


def _pick(new: _T | Clear | None, old: _T | None) -> _T | None:
    if new is None:
        return old
    return None if isinstance(new, Clear) else new


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time, sqrt(2 * cost * MTBF)
    (Young 1974; Daly 2006 to first order), clamped to [MIN_INTERVAL_S, MAX_AUTO_INTERVAL_S].
    A cost under MIN_COST_S (zero, unmeasured, NaN) uses MIN_COST_S; an MTBF that is not
    positive counts as tiny, the side that snapshots more."""
    cost = cost_s if cost_s > MIN_COST_S else MIN_COST_S  # also catches NaN
    if not mtbf_s > 0:
        return MIN_INTERVAL_S
    return min(max(math.sqrt(2.0 * cost * mtbf_s), MIN_INTERVAL_S), MAX_AUTO_INTERVAL_S)


@dataclass(frozen=True)
class FailureRate:
    """What the cluster observed, over every node it has run jobs on."""

    node_seconds: float  # sum over registered nodes of the time each was observed alive
    failures: int  # node/rank failures observed


def node_mtbf(rate: FailureRate, prior_node_mtbf_s: float, prior_weight: float = 1.0) -> float:
    """Per-node MTBF: observed node-seconds over observed failures, with the prior counted as
    `prior_weight` pseudo-failures over `prior_weight * prior` seconds. A new cluster (no data)
    gets the prior; a cluster with a long record gets its own rate.

    Raises:
        InvalidArgument: a prior or weight that is not positive, or negative observations.
    """
    if not (prior_node_mtbf_s > 0 and prior_weight > 0):
        raise errors.InvalidArgument(
            f"prior node MTBF {prior_node_mtbf_s!r}s with weight {prior_weight!r} is unusable",
            f"use a positive prior (default {DEFAULT_PRIOR_NODE_MTBF_S:g}s) and weight",
        )
    if not (rate.node_seconds >= 0 and rate.failures >= 0):
        raise errors.InvalidArgument(
            f"observed failure rate {rate} has negative counts",
            "report this as a coordinator bug; the counters only grow",
        )
    return (rate.node_seconds + prior_weight * prior_node_mtbf_s) / (rate.failures + prior_weight)


def job_mtbf(
    rate: FailureRate, nnodes: int, prior_node_mtbf_s: float, prior_weight: float = 1.0
) -> float:
    """The job's MTBF: any one of its `nnodes` nodes failing stops it, so the per-node MTBF
    divided by nnodes (independent, exponentially distributed failures).

    Raises:
        InvalidArgument: nnodes under 1, or what node_mtbf rejects.
    """
    if nnodes < 1:
        raise errors.InvalidArgument(
            f"a job of {nnodes} nodes has no MTBF", "pass the job's node count (1 or more)"
        )
    return node_mtbf(rate, prior_node_mtbf_s, prior_weight) / nnodes


def _recent_stalls(stalls_s: Sequence[float]) -> list[float]:
    # Oldest first, as the caller appends them; a broken measurement (NaN, negative) is dropped
    # rather than allowed to drag the median.
    usable = [x for x in stalls_s if math.isfinite(x) and x >= 0]
    return usable[-FREEZE_COST_WINDOW:]


def freeze_cost(stalls_s: Sequence[float], default_s: float = DEFAULT_FREEZE_COST_S) -> float:
    """The cost of one snapshot: the median of the job's newest measured freeze stalls (oldest
    first in `stalls_s`), or `default_s` before any. The median, so that one freeze behind a slow
    store does not swing the interval."""
    recent = _recent_stalls(stalls_s)
    return float(statistics.median(recent)) if recent else default_s


@dataclass(frozen=True)
class AutoInputs:
    """Everything the auto interval came from, for `policy show`."""

    cost_s: float
    cost_measured: int  # how many measured stalls cost_s is the median of (0: the default)
    node_mtbf_s: float
    failures: int
    node_seconds: float
    nnodes: int
    job_mtbf_s: float
    interval_s: float

    def describe(self) -> str:
        cost = (
            f"median of {self.cost_measured} freeze(s)" if self.cost_measured else "no freeze yet"
        )
        return (
            f"every {format_duration(self.interval_s)} = sqrt(2 x cost {self.cost_s:.1f}s "
            f"({cost}) x job MTBF {self.job_mtbf_s / 3600:.1f}h); node MTBF "
            f"{self.node_mtbf_s / 3600:.1f}h from {self.failures} failure(s) in "
            f"{self.node_seconds / 3600:.1f} node-hours and the prior, over {self.nnodes} node(s)"
        )


def auto_interval(
    stalls_s: Sequence[float],
    rate: FailureRate,
    nnodes: int,
    prior_node_mtbf_s: float = DEFAULT_PRIOR_NODE_MTBF_S,
    prior_weight: float = 1.0,
) -> AutoInputs:
    """The Young–Daly interval for one job from its freezes and the cluster's failures.

    Raises:
        InvalidArgument: what job_mtbf rejects.
    """
    cost = freeze_cost(stalls_s)
    per_node = node_mtbf(rate, prior_node_mtbf_s, prior_weight)
    mtbf = job_mtbf(rate, nnodes, prior_node_mtbf_s, prior_weight)
    return AutoInputs(
        cost_s=cost,
        cost_measured=len(_recent_stalls(stalls_s)),
        node_mtbf_s=per_node,
        failures=rate.failures,
        node_seconds=rate.node_seconds,
        nnodes=nnodes,
        job_mtbf_s=mtbf,
        interval_s=young_daly(cost, mtbf),
    )


@dataclass(frozen=True)
class PolicyState:
    """One job's policy bookkeeping, kept by the caller and replaced, never mutated."""

    anchor: float | None = None  # monotonic time the interval counts from (start/last freeze end)
    anchor_steps: int | None = None  # optimizer steps at the last snapshot's start
    running_since: float | None = None  # a freeze started by the policy is still running
    failures: int = 0  # consecutive failed/refused policy freezes
    last_attempt: float | None = None  # when the last attempt began, then when it ended
    last_error: str = ""


@dataclass(frozen=True)
class Due:
    """decide's answer; `reason` says why or why not, in words a user reads in `policy show`."""

    due: bool
    reason: str
    wait_s: float | None  # seconds until due by the time rule; None when unknown or steps only


def lag_s(s: PolicyState, now: float, interval_s: float | None) -> float:
    """How late a policy snapshot starting `now` is: the seconds since the time rule made it
    due (0 when the step rule made it due first, or the interval is not known yet)."""
    if interval_s is None or s.anchor is None:
        return 0.0
    return max(0.0, now - (s.anchor + interval_s))


def normalize(s: PolicyState, now: float, steps: int | None) -> PolicyState:
    """Fold what the caller just observed into the state, before `decide`.

    A monotonic clock that went back (a coordinator restored elsewhere, a fake clock) would
    leave the anchor in the future and the job unsnapshotted until the clock caught up: count
    from now instead. A step counter below the anchor means the job was thawed from an older
    snapshot: count steps from here. An unanchored state starts counting now."""
    anchor = now if s.anchor is None or s.anchor > now else s.anchor
    last = s.last_attempt if s.last_attempt is None or s.last_attempt <= now else now
    anchor_steps = s.anchor_steps
    if steps is not None and (anchor_steps is None or steps < anchor_steps):
        anchor_steps = steps
    return replace(s, anchor=anchor, anchor_steps=anchor_steps, last_attempt=last)


def _backoff_s(failures: int, interval_s: float | None) -> float:
    cap = interval_s if interval_s is not None else STEP_ONLY_BACKOFF_CAP_S
    # The exponent is capped so that a job refused for months cannot overflow the float.
    return min(cap, BACKOFF_BASE_S * 2.0 ** min(failures - 1, 64))


def decide(
    p: Policy, s: PolicyState, now: float, steps: int | None, interval_s: float | None,
    measured: bool = True,
) -> Due:  # fmt: skip
    """Whether the policy's next snapshot of a job is due now.

    `interval_s` is the effective time interval: `every_s`, or the auto interval the caller
    computed (None before it has: the time rule waits). The time rule fires once `interval_s`
    has passed since the anchor, the step rule once `every_steps` steps have passed since the
    last snapshot's start; either makes it due. Never due while a policy freeze runs, before the
    job is anchored, or while backing off after failures (BACKOFF_BASE_S doubling per
    consecutive failure, at most the interval, so a job that can never be quiesced is tried
    about once per interval and never hammered). A state `normalize` has not seen yet is read
    safely: a future anchor counts as now, a step counter that went back fires nothing.

    `auto` before the job's freeze cost was `measured`: the first snapshot is due as soon as the
    job trains (its step count moved past the anchor), so that the interval rests on a measured
    cost rather than the default, and the start-up (imports, data, model build) is never lost
    to an early failure.
    """
    if not p.active:
        return Due(False, "no periodic snapshots in this job's policy", None)
    if s.running_since is not None:
        return Due(
            False,
            f"overlap: the policy freeze started {max(now - s.running_since, 0.0):.0f}s ago is "
            "still running; the next one waits for it",
            None,
        )
    if s.anchor is None:
        return Due(False, "the job is not anchored yet (no start time recorded)", None)

    interval = None
    if p.timed:
        interval = interval_s if interval_s is not None else p.every_s
        if interval is not None and not interval >= MIN_INTERVAL_S:  # also NaN
            interval = MIN_INTERVAL_S
    why_not: list[str] = []
    fired: list[str] = []
    wait: float | None = None

    if interval is not None:
        elapsed = max(now - s.anchor, 0.0)  # a future anchor: the clock went back
        if elapsed >= interval:
            fired.append(
                f"{elapsed:.0f}s since the last snapshot (interval {format_duration(interval)})"
            )
        else:
            wait = interval - elapsed
            why_not.append(f"next in {wait:.0f}s (interval {format_duration(interval)})")
    elif p.timed:
        why_not.append("the auto interval is not computed yet")

    if p.every_steps is not None:
        if steps is None:
            why_not.append("the step count is unknown")
        elif s.anchor_steps is None:
            why_not.append("the step count is not anchored yet")
        elif steps < s.anchor_steps:
            why_not.append(f"the step count went back to {steps} (thawed from an older snapshot)")
        elif steps - s.anchor_steps >= p.every_steps:
            fired.append(f"{steps - s.anchor_steps} steps since the last snapshot")
        else:
            why_not.append(f"{p.every_steps - (steps - s.anchor_steps)} more step(s)")

    if (p.auto and not measured and steps is not None and s.anchor_steps is not None
            and steps > s.anchor_steps):  # fmt: skip
        fired.append("the job trains and no freeze of it was measured yet (auto measures one)")

    if not fired:
        return Due(False, "not due: " + "; ".join(why_not), wait)

    if s.failures > 0 and s.last_attempt is not None:
        backoff = _backoff_s(s.failures, interval)
        since = max(now - s.last_attempt, 0.0)
        if since < backoff:
            last = f" (last: {s.last_error})" if s.last_error else ""
            return Due(
                False,
                f"backing off after {s.failures} failed attempt(s){last}; "
                f"next try in {backoff - since:.0f}s",
                backoff - since,
            )
    return Due(True, "due: " + "; ".join(fired), 0.0)


def started(s: PolicyState, now: float, steps: int | None) -> PolicyState:
    """A policy freeze began. An unanchored state is anchored here, so that a failure (which
    keeps the anchor) cannot leave it unanchored for ever."""
    return replace(
        s,
        running_since=now,
        last_attempt=now,
        anchor=now if s.anchor is None else s.anchor,
        anchor_steps=steps if s.anchor_steps is None else s.anchor_steps,
    )


def finished(
    s: PolicyState, now: float, steps_at_start: int | None, ok: bool, error: str = ""
) -> PolicyState:
    """A policy freeze ended (or was refused, with ok=False). Success counts the interval from
    now and the steps from the freeze's start. Failure keeps both anchors, so the snapshot stays
    due and only the backoff spaces the retries."""
    if ok:
        return replace(
            s,
            anchor=now,
            anchor_steps=steps_at_start if steps_at_start is not None else s.anchor_steps,
            running_since=None,
            failures=0,
            last_attempt=now,
            last_error="",
        )
    return replace(
        s, running_since=None, failures=s.failures + 1, last_attempt=now, last_error=error
    )


def reanchor(s: PolicyState, now: float, steps: int | None) -> PolicyState:
    """The job (re)started or was thawed: a new life counts from now, without the old one's
    failures. A policy freeze still in flight stays recorded, so none overlaps it."""
    return PolicyState(anchor=now, anchor_steps=steps, running_since=s.running_since)


def to_expire(
    snaps: Sequence[tuple[str, float]],
    p: Policy,
    now_wall: float,
    protected: Collection[str],
) -> list[str]:
    """The committed snapshots of one job that retention deletes, oldest first.

    `snaps` are (snapshot id, created epoch seconds). Kept: the newest `keep`; with
    keep_hourly_days, the newest of each UTC hour created in the last that many days; the same
    per UTC day for keep_daily_days. Never returned: a protected id (a thaw is reading it) and
    the newest snapshot, whatever the policy says. keep None keeps everything.
    """
    if p.keep is None or not snaps:
        return []
    created: dict[str, float] = {}
    for sid, t in snaps:
        created[sid] = max(t, created.get(sid, t))
    # Newest first; ties broken by id so that the choice is the same on every call.
    newest_first = sorted(created, key=lambda i: (created[i], i), reverse=True)
    kept = set(newest_first[: max(p.keep, 1)]) | set(protected)
    for days, bucket_s in ((p.keep_hourly_days, 3600.0), (p.keep_daily_days, 86400.0)):
        if not days:
            continue
        since = now_wall - days * 86400.0
        seen: set[float] = set()
        for sid in newest_first:
            # Epoch seconds are UTC without leap seconds: floor division gives UTC hours/days.
            bucket = created[sid] // bucket_s
            if created[sid] >= since and bucket not in seen:
                kept.add(sid)
            seen.add(bucket)
    return [sid for sid in reversed(newest_first) if sid not in kept]
