"""Snapshot policies (coordinator/policy.py): pure decisions driven by a fake clock."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from snapshotter import errors
from snapshotter.coordinator.policy import (
    BACKOFF_BASE_S,
    CLEAR,
    DEFAULT_PRIOR_NODE_MTBF_S,
    MAX_AUTO_INTERVAL_S,
    MIN_COST_S,
    MIN_INTERVAL_S,
    STEP_ONLY_BACKOFF_CAP_S,
    Due,
    FailureRate,
    Policy,
    PolicyState,
    auto_interval,
    check,
    decide,
    finished,
    format_duration,
    freeze_cost,
    job_mtbf,
    lag_s,
    merge,
    normalize,
    parse_every,
    reanchor,
    started,
    to_expire,
    young_daly,
)
from snapshotter.coordinator.supervisor import POLICY_QUIESCE_TIMEOUT_S, policy_quiesce_timeout

HOUR = 3600.0
DAY = 86400.0


# --- the coordinator thread, simulated against a fake clock ---


@dataclass
class Sim:
    """What the coordinator's policy thread does each second for one job: normalize, decide,
    start a freeze when due, and report its end `freeze_s` later with `outcome(n)`."""

    policy: Policy
    interval_s: float | None
    freeze_s: float = 0.0
    outcome: Callable[[int], tuple[bool, str]] = lambda n: (True, "")
    now: float = 1000.0
    steps: int | None = None
    steps_per_s: int = 0
    starts: list[float] = field(default_factory=list)
    state: PolicyState = field(init=False)
    _ends_at: float | None = None
    _steps_at_start: int | None = None

    def __post_init__(self) -> None:
        self.state = reanchor(PolicyState(), self.now, self.steps)

    def _finish(self) -> None:
        ok, err = self.outcome(len(self.starts))
        self.state = finished(self.state, self.now, self._steps_at_start, ok, err)
        self._ends_at = None

    def tick(self, dt: float = 1.0) -> Due:
        self.now += dt
        if self.steps is not None:
            self.steps += self.steps_per_s
        if self._ends_at is not None and self.now >= self._ends_at:
            self._finish()
        self.state = normalize(self.state, self.now, self.steps)
        d = decide(self.policy, self.state, self.now, self.steps, self.interval_s)
        if d.due:
            assert self._ends_at is None, "a second freeze started while one runs"
            self.starts.append(self.now)
            self.state = started(self.state, self.now, self.steps)
            self._steps_at_start = self.steps
            self._ends_at = self.now + self.freeze_s
            if self.freeze_s == 0:
                self._finish()
        return d

    def run_for(self, seconds: int) -> list[Due]:
        return [self.tick() for _ in range(seconds)]


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


# --- parsing and checking flags ---


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30.0), ("10m", 600.0), ("1h", 3600.0), ("1.5h", 5400.0), ("90", 90.0)]
    + [(" 2M ", 120.0), ("5s", 5.0), ("0.5m", 30.0), (".5h", 1800.0)],
)
def test_parse_every_durations(text: str, seconds: float) -> None:
    assert parse_every(text) == (seconds, False)


def test_parse_every_auto_and_off() -> None:
    assert parse_every("auto") == (None, True)
    assert parse_every("AUTO") == (None, True)
    assert parse_every("off") == (None, False)
    assert parse_every("") == (None, False)


@pytest.mark.parametrize(
    "text", ["0", "0s", "-5", "-1m", "4s", "4.9", "abc", "10 minutes", "1d", "nan", "inf", "1h30m"]
)
def test_parse_every_rejects_with_the_flag_and_the_forms(text: str) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        parse_every(text)
    assert "--snapshot-every" in e.value.cause
    assert "10m" in e.value.next_step and "auto" in e.value.next_step


def test_format_duration_reads_back_through_parse_every() -> None:
    assert format_duration(600) == "10m"
    assert format_duration(5400) == "1.5h"
    assert format_duration(30) == "30s"
    assert format_duration(848.528) == "849s"
    for s in (5.0, 30.0, 90.0, 600.0, 5400.0, 7200.0, 848.528):
        back, auto = parse_every(format_duration(s))
        assert back is not None and not auto and abs(back - s) <= 0.5


@pytest.mark.parametrize(
    "bad",
    [
        Policy(every_s=60.0, auto=True),
        Policy(every_s=1.0),
        Policy(every_s=math.nan),
        Policy(keep=0),
        Policy(keep=-3),
        Policy(every_steps=0),
        Policy(keep=2, keep_hourly_days=-1.0),
        Policy(keep=2, keep_daily_days=-0.5),
        Policy(keep=2, keep_daily_days=math.inf),
    ],
)
def test_check_rejects_contradictions(bad: Policy) -> None:
    with pytest.raises(errors.InvalidArgument) as e:
        check(bad)
    assert e.value.next_step  # always says what to do


def test_check_accepts_sound_policies() -> None:
    check(Policy())
    check(Policy(every_s=MIN_INTERVAL_S, keep=1, keep_hourly_days=0.0))
    check(Policy(auto=True, every_steps=1, keep=5, keep_hourly_days=2, keep_daily_days=30))


def test_active_needs_a_rule_that_takes_snapshots() -> None:
    assert not Policy().active
    assert not Policy(keep=3, keep_daily_days=7).active
    assert Policy(every_s=60).active
    assert Policy(auto=True).active
    assert Policy(every_steps=100).active


# --- policy set ---


def test_merge_changes_only_the_flags_given() -> None:
    old = Policy(every_s=600.0, every_steps=500, keep=3, keep_hourly_days=2.0)
    assert merge(old) == old
    assert merge(old, keep=5) == Policy(every_s=600.0, every_steps=500, keep=5, keep_hourly_days=2)
    assert merge(old, keep_daily_days=7.0) == Policy(
        every_s=600.0, every_steps=500, keep=3, keep_hourly_days=2.0, keep_daily_days=7.0
    )


def test_merge_snapshot_every_replaces_both_interval_and_auto() -> None:
    fixed = Policy(every_s=600.0, keep=3)
    every_s, auto = parse_every("auto")
    assert merge(fixed, every_s=every_s, auto=auto) == Policy(auto=True, keep=3)
    every_s, auto = parse_every("1h")
    assert merge(Policy(auto=True, keep=3), every_s=every_s, auto=auto) == Policy(
        every_s=3600.0, keep=3
    )
    assert merge(Policy(auto=True), every_s=30.0) == Policy(every_s=30.0)
    every_s, auto = parse_every("off")
    assert merge(fixed, every_s=every_s, auto=auto) == Policy(keep=3)


def test_merge_clear_removes_a_setting() -> None:
    old = Policy(every_s=600.0, every_steps=500, keep=3, keep_hourly_days=2.0)
    assert merge(old, every_steps=CLEAR, keep=CLEAR, keep_hourly_days=CLEAR) == Policy(
        every_s=600.0
    )


def test_merge_refuses_what_check_refuses() -> None:
    with pytest.raises(errors.InvalidArgument):
        merge(Policy(every_s=600.0), keep=0)
    with pytest.raises(errors.InvalidArgument):
        merge(Policy(), every_s=600.0, auto=True)


def test_policy_round_trips_through_json() -> None:
    for p in (
        Policy(),
        Policy(every_s=600.0, keep=3),
        Policy(auto=True, every_steps=500, keep=5, keep_hourly_days=2.0, keep_daily_days=30.0),
    ):
        assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_from_dict_defaults_missing_keys_and_drops_unknown_ones() -> None:
    assert Policy.from_dict({"every_s": 90, "later_field": 1}) == Policy(every_s=90.0)


@pytest.mark.parametrize(
    "d",
    [{"every_s": "10m"}, {"keep": True}, {"keep": 2.5}, {"auto": 1}, {"every_s": 60, "auto": True}],
)
def test_from_dict_rejects_wrong_types_and_contradictions(d: dict[str, object]) -> None:
    with pytest.raises(errors.InvalidArgument):
        Policy.from_dict(d)


def test_describe() -> None:
    assert Policy(every_s=600.0, keep=3).describe() == "every 10m, keep 3"
    assert (
        Policy(auto=True, every_steps=500, keep=5, keep_hourly_days=2.0).describe()
        == "auto (Young–Daly), every 500 steps, keep 5, hourly for 2 days"
    )
    assert Policy().describe() == "off"
    assert Policy(keep=2).describe() == "no periodic snapshots, keep 2"
    assert Policy(every_s=5400.0, keep_daily_days=1.0).describe() == (
        "every 1.5h, keep all, daily for 1 day"
    )


# --- the auto interval ---


def test_young_daly_numbers() -> None:
    assert young_daly(10.0, 10 * HOUR) == pytest.approx(848.528, abs=1e-3)
    assert young_daly(10.0, 10 * HOUR) == pytest.approx(math.sqrt(2 * 10 * 36000))
    assert young_daly(60.0, 30 * DAY) == pytest.approx(math.sqrt(2 * 60 * 30 * DAY))


def test_young_daly_clamps() -> None:
    assert young_daly(1.0, 2.0) == MIN_INTERVAL_S
    assert young_daly(3600.0, 10 * 365 * DAY) == MAX_AUTO_INTERVAL_S
    assert young_daly(10.0, math.inf) == MAX_AUTO_INTERVAL_S
    assert young_daly(10.0, 0.0) == MIN_INTERVAL_S
    floored = math.sqrt(2 * MIN_COST_S * 10 * HOUR)
    for cost in (0.0, -5.0, math.nan, MIN_COST_S / 10):
        assert young_daly(cost, 10 * HOUR) == pytest.approx(floored)


def test_job_mtbf_without_data_is_the_prior_over_the_nodes() -> None:
    none = FailureRate(node_seconds=0.0, failures=0)
    assert job_mtbf(none, 1, 30 * DAY) == 30 * DAY
    assert job_mtbf(none, 4, 30 * DAY) == 30 * DAY / 4


def test_job_mtbf_with_data() -> None:
    # 100 observed node-days with 9 failures, plus the prior as 1 failure in 30 days:
    # 130 node-days / 10 failures = 13 days per node; a 2-node job fails twice as often.
    rate = FailureRate(node_seconds=100 * DAY, failures=9)
    assert job_mtbf(rate, 2, 30 * DAY) == pytest.approx(6.5 * DAY)
    assert job_mtbf(rate, 2, 30 * DAY, prior_weight=2.0) == pytest.approx(160 / 11 / 2 * DAY)
    # A long record outweighs the prior: close to its own 10 days per node.
    long = FailureRate(node_seconds=10_000 * DAY, failures=1000)
    assert job_mtbf(long, 1, 30 * DAY) == pytest.approx(10 * DAY, rel=0.01)


@pytest.mark.parametrize(
    ("rate", "nnodes", "prior"),
    [
        (FailureRate(0.0, 0), 0, 30 * DAY),
        (FailureRate(0.0, 0), 1, 0.0),
        (FailureRate(0.0, -1), 1, 30 * DAY),
        (FailureRate(-1.0, 0), 1, 30 * DAY),
    ],
)
def test_job_mtbf_rejects_nonsense(rate: FailureRate, nnodes: int, prior: float) -> None:
    with pytest.raises(errors.InvalidArgument):
        job_mtbf(rate, nnodes, prior)


def test_freeze_cost_is_the_median_of_the_newest_stalls() -> None:
    assert freeze_cost([]) == 10.0
    assert freeze_cost([], default_s=3.0) == 3.0
    assert freeze_cost([3.0]) == 3.0
    assert freeze_cost([1.0, 100.0, 2.0]) == 2.0  # one slow freeze does not swing it
    assert freeze_cost([1000.0] * 5 + [1.0] * 10) == 1.0  # only the newest 10 count
    assert freeze_cost([math.nan, -1.0, 4.0]) == 4.0


def test_auto_interval_says_what_it_came_from() -> None:
    a = auto_interval([12.0, 8.0, 10.0], FailureRate(0.0, 0), 4, prior_node_mtbf_s=40 * HOUR)
    assert (a.cost_s, a.cost_measured, a.nnodes) == (10.0, 3, 4)
    assert a.node_mtbf_s == 40 * HOUR and a.job_mtbf_s == 10 * HOUR
    assert a.interval_s == pytest.approx(848.528, abs=1e-3)
    assert "849s" in a.describe() and "median of 3" in a.describe()


def test_auto_interval_before_any_data_uses_the_documented_defaults() -> None:
    a = auto_interval([], FailureRate(0.0, 0), 1)
    assert a.cost_measured == 0 and a.node_mtbf_s == DEFAULT_PRIOR_NODE_MTBF_S
    # 10 s default cost, 30 days: sqrt(2 * 10 * 2,592,000) = 7200 s.
    assert DEFAULT_PRIOR_NODE_MTBF_S == 30 * DAY
    assert a.interval_s == pytest.approx(7200.0)
    assert a.describe().startswith("every 2h")


# --- when a snapshot is due ---


def test_inactive_and_unanchored_are_never_due() -> None:
    s = PolicyState(anchor=0.0, anchor_steps=0)
    assert not decide(Policy(keep=3), s, 1e9, 10**9, 60.0).due
    d = decide(Policy(every_s=60.0), PolicyState(), 1e9, None, 60.0)
    assert not d.due and "anchored" in d.reason


def test_time_rule() -> None:
    p = Policy(every_s=60.0)
    s = PolicyState(anchor=100.0)
    d = decide(p, s, 159.0, None, 60.0)
    assert not d.due and d.wait_s == pytest.approx(1.0)
    d = decide(p, s, 160.0, None, 60.0)
    assert d.due and d.wait_s == 0.0 and "60s since the last snapshot" in d.reason
    # Without an interval from the caller, a fixed one is the policy's own.
    assert decide(p, s, 160.0, None, None).due
    assert not decide(p, s, 159.0, None, None).due


def test_auto_waits_for_the_caller_to_compute_the_interval() -> None:
    p = Policy(auto=True)
    s = PolicyState(anchor=0.0)
    d = decide(p, s, 1e6, None, None)
    assert not d.due and "auto interval" in d.reason
    assert decide(p, s, 849.0, None, 848.5).due
    assert not decide(p, s, 848.0, None, 848.5).due


def test_auto_measures_its_first_freeze_as_soon_as_the_job_trains() -> None:
    p = Policy(auto=True)
    s = PolicyState(anchor=0.0, anchor_steps=0)
    assert not decide(p, s, 5.0, 0, 900.0, measured=False).due  # still starting up
    d = decide(p, s, 5.0, 1, 900.0, measured=False)
    assert d.due and "measured" in d.reason
    assert not decide(p, s, 5.0, 1, 900.0, measured=True).due  # then the interval rules
    assert not decide(p, s, 5.0, None, 900.0, measured=False).due  # no step count: interval
    assert not decide(Policy(every_s=900.0), s, 5.0, 1, None, measured=False).due
    running = PolicyState(anchor=0.0, anchor_steps=0, running_since=4.0)
    assert not decide(p, running, 5.0, 1, 900.0, measured=False).due  # never overlaps


def test_step_rule() -> None:
    p = Policy(every_steps=100)
    s = PolicyState(anchor=0.0, anchor_steps=1000)
    d = decide(p, s, 5.0, 1099, None)
    assert not d.due and d.wait_s is None and "1 more step(s)" in d.reason
    d = decide(p, s, 5.0, 1100, None)
    assert d.due and "100 steps" in d.reason
    d = decide(p, s, 5.0, None, None)
    assert not d.due and "unknown" in d.reason


def test_step_counter_going_back_reanchors_instead_of_firing() -> None:
    p = Policy(every_steps=100)
    s = PolicyState(anchor=0.0, anchor_steps=1000)
    d = decide(p, s, 5.0, 500, None)  # thawed from an older snapshot
    assert not d.due and "went back" in d.reason
    s = normalize(s, 5.0, 500)
    assert s.anchor_steps == 500
    assert not decide(p, s, 6.0, 599, None).due
    assert decide(p, s, 6.0, 600, None).due


def test_either_rule_makes_it_due() -> None:
    p = Policy(every_s=600.0, every_steps=100)
    s = PolicyState(anchor=0.0, anchor_steps=0)
    assert not decide(p, s, 10.0, 50, 600.0).due
    assert decide(p, s, 10.0, 100, 600.0).due  # steps fired, time did not
    assert decide(p, s, 600.0, 50, 600.0).due  # time fired, steps did not
    assert decide(p, s, 600.0, None, 600.0).due  # unknown steps do not block the time rule


def test_steps_anchor_at_the_snapshot_start_and_time_at_its_end() -> None:
    s = started(PolicyState(anchor=0.0, anchor_steps=0), now=100.0, steps=400)
    assert s.running_since == 100.0
    s = finished(s, now=130.0, steps_at_start=400, ok=True)
    assert (s.anchor, s.anchor_steps, s.running_since, s.failures) == (130.0, 400, None, 0)


def test_step_policy_in_the_simulated_thread() -> None:
    sim = Sim(Policy(every_steps=100), None, freeze_s=5.0, steps=0, steps_per_s=10)
    sim.run_for(60)
    # Due every 100 steps (10 s) counted from each freeze's start: 1010, 1020, ...
    assert sim.starts == [1010.0 + 10 * i for i in range(6)]


# --- overlap, failures, clock jumps ---


def test_a_running_freeze_is_never_overlapped() -> None:
    p = Policy(every_s=60.0)
    s = started(PolicyState(anchor=0.0), now=60.0, steps=None)
    d = decide(p, s, 500.0, None, 60.0)
    assert not d.due and "overlap" in d.reason


def test_a_freeze_longer_than_the_interval_is_followed_by_one_snapshot_not_a_burst() -> None:
    sim = Sim(Policy(every_s=60.0), 60.0, freeze_s=140.0)
    dues = sim.run_for(500)
    # Each freeze runs 140 s; the next is due 60 s after it ends, and only once.
    assert sim.starts == [1060.0, 1260.0, 1460.0]
    assert sum(d.due for d in dues) == 3
    # 139 ticks inside each of the first two freezes, 40 inside the third when the run ends.
    assert sum("overlap" in d.reason for d in dues) == 139 + 139 + 40


def test_a_never_quiesceable_job_is_retried_ever_more_slowly_up_to_the_interval() -> None:
    sim = Sim(Policy(every_s=600.0), 600.0, outcome=lambda n: (False, "quiesce timed out"))
    sim.run_for(4 * 3600)
    g = gaps(sim.starts)
    assert sim.starts[0] == 1600.0
    want = [BACKOFF_BASE_S * 2**k for k in range(6)]  # 10, 20, 40, 80, 160, 320
    assert g[:6] == want
    assert all(x == 600.0 for x in g[6:]) and len(g) > 10
    assert sim.state.failures == len(sim.starts)
    d = decide(sim.policy, sim.state, sim.now, None, 600.0)
    assert not d.due and "quiesce timed out" in d.reason and 0 < (d.wait_s or 0) <= 600


def test_backoff_counts_from_the_end_of_the_failed_attempt() -> None:
    sim = Sim(Policy(every_s=600.0), 600.0, freeze_s=30.0, outcome=lambda n: (n > 2, "busy"))
    sim.run_for(1400)
    # 1600 fails at 1630, 1640 (+10 after the end) fails at 1670, 1690 (+20) succeeds at 1720;
    # then the interval counts from that success: 2320.
    assert sim.starts == [1600.0, 1640.0, 1690.0, 2320.0]
    assert sim.state.failures == 0


def test_a_step_only_policy_backs_off_to_a_minute_at_most() -> None:
    sim = Sim(Policy(every_steps=10), None, steps=0, steps_per_s=1, outcome=lambda n: (False, "x"))
    sim.run_for(1000)
    g = gaps(sim.starts)
    assert g[:3] == [10.0, 20.0, 40.0]
    assert max(g) == STEP_ONLY_BACKOFF_CAP_S and all(x == 60.0 for x in g[3:])


def test_clock_going_back_waits_one_interval_never_a_negative_wait() -> None:
    p = Policy(every_s=60.0)
    s = PolicyState(anchor=1000.0)
    d = decide(p, s, 900.0, None, 60.0)
    assert not d.due and d.wait_s == 60.0
    s = normalize(s, 900.0, None)
    assert s.anchor == 900.0
    assert not decide(p, s, 959.0, None, 60.0).due
    assert decide(p, s, 960.0, None, 60.0).due
    # A backoff recorded in the future is clamped too.
    failing = normalize(PolicyState(anchor=0.0, failures=1, last_attempt=5000.0), 900.0, None)
    assert failing.last_attempt == 900.0
    assert decide(p, failing, 910.0, None, 60.0).due


def test_clock_jumping_back_in_the_simulated_thread() -> None:
    sim = Sim(Policy(every_s=60.0), 60.0)
    sim.run_for(30)
    sim.tick(-1000.0)  # a coordinator restored on a machine whose monotonic clock is younger
    sim.run_for(100)
    # The jump lands at 30: the anchor (1000) counts as 30, so the next one is due at 90, not
    # after the clock has caught up with 1060.
    assert sim.starts == [90.0]


def test_clock_jumping_forward_yields_one_snapshot_not_a_catch_up() -> None:
    sim = Sim(Policy(every_s=60.0), 60.0, freeze_s=5.0)
    sim.run_for(30)
    sim.tick(DAY)  # suspended for a day
    jumped = sim.now
    sim.run_for(120)
    assert sim.starts == [jumped, jumped + 5.0 + 60.0]


def test_reanchor_starts_a_new_life_without_the_old_failures() -> None:
    s = PolicyState(anchor=0.0, anchor_steps=900, failures=4, last_attempt=50.0, last_error="x")
    assert reanchor(s, 100.0, 10) == PolicyState(anchor=100.0, anchor_steps=10)
    running = started(PolicyState(anchor=0.0), 50.0, None)
    assert reanchor(running, 100.0, None).running_since == 50.0


def test_failure_keeps_the_anchors() -> None:
    s = started(PolicyState(anchor=10.0, anchor_steps=7), 70.0, 99)
    s = finished(s, 75.0, 99, ok=False, error="freeze refused: job busy")
    assert (s.anchor, s.anchor_steps, s.failures, s.last_attempt) == (10.0, 7, 1, 75.0)
    assert s.last_error == "freeze refused: job busy" and s.running_since is None


# --- retention ---


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float:
    return datetime(y, mo, d, h, mi, s, tzinfo=UTC).timestamp()


def test_keep_k_expires_the_rest_oldest_first() -> None:
    snaps = [(f"s{i}", float(i)) for i in (3, 1, 5, 2, 4)]
    assert to_expire(snaps, Policy(keep=2), 10.0, ()) == ["s1", "s2", "s3"]
    assert to_expire(snaps, Policy(keep=5), 10.0, ()) == []
    assert to_expire(snaps, Policy(), 10.0, ()) == []  # keep None keeps everything
    assert to_expire([], Policy(keep=1), 10.0, ()) == []


def test_protected_and_newest_never_expire() -> None:
    snaps = [(f"s{i}", float(i)) for i in range(1, 6)]
    assert to_expire(snaps, Policy(keep=1), 10.0, {"s2"}) == ["s1", "s3", "s4"]
    # Even a policy that slipped past check() keeps the newest.
    assert to_expire(snaps, Policy(keep=0), 10.0, ()) == ["s1", "s2", "s3", "s4"]


def test_ties_are_broken_by_id() -> None:
    snaps = [("b", 1.0), ("a", 1.0), ("c", 1.0)]
    assert to_expire(snaps, Policy(keep=1), 2.0, ()) == ["a", "b"]


def test_hourly_keeps_the_newest_of_each_utc_hour_in_the_window() -> None:
    now = utc(2026, 1, 10, 12, 0)
    snaps = [(f"{h:02d}{m}", utc(2026, 1, 10, h, m)) for h in (8, 9, 10, 11) for m in (15, 45)]
    p = Policy(keep=1, keep_hourly_days=3 / 24)  # the window starts at 09:00
    # 09:45, 10:45 and 11:45 are their hours' newest; 08:45 is older than the window.
    assert to_expire(snaps, p, now, ()) == ["0815", "0845", "0915", "1015", "1115"]


def test_daily_keeps_the_newest_of_each_utc_day_in_the_window() -> None:
    now = utc(2026, 1, 10, 18, 0)
    snaps = [(f"d{d}", utc(2026, 1, d, 12, 0)) for d in range(1, 11)]
    snaps.append(("d10-early", utc(2026, 1, 10, 0, 30)))
    p = Policy(keep=2, keep_daily_days=3.0)  # the window starts on the 7th at 18:00
    assert to_expire(snaps, p, now, ()) == [f"d{d}" for d in range(1, 8)]


def test_buckets_split_at_utc_midnight() -> None:
    now = utc(2026, 1, 3, 0, 0)
    snaps = [
        ("before", utc(2026, 1, 1, 23, 59, 59)),
        ("after", utc(2026, 1, 2, 0, 0, 1)),
        ("newest", utc(2026, 1, 2, 12, 0)),
    ]
    # "before" is the only one of its day; "after" is not its day's newest.
    assert to_expire(snaps, Policy(keep=1, keep_daily_days=7.0), now, ()) == ["after"]


def test_hourly_and_daily_together() -> None:
    now = utc(2026, 1, 10, 12, 0)
    snaps = [
        ("old-day", utc(2026, 1, 8, 9, 0)),
        ("old-day-late", utc(2026, 1, 8, 20, 0)),
        ("hour-a", utc(2026, 1, 10, 10, 10)),
        ("hour-b", utc(2026, 1, 10, 10, 50)),
        ("newest", utc(2026, 1, 10, 11, 30)),
    ]
    p = Policy(keep=1, keep_hourly_days=0.5, keep_daily_days=5.0)
    assert to_expire(snaps, p, now, ()) == ["old-day", "hour-a"]
    assert to_expire(snaps, p, now, {"hour-a"}) == ["old-day"]


def test_a_policy_freeze_parks_no_longer_than_the_hang_deadline() -> None:
    """Under --recover auto a policy freeze gives up on a rank that does not park within the
    hang deadline, so that hang detection (which a freeze holds off) is not delayed by it."""
    assert policy_quiesce_timeout(recovers=True, hang_deadline_s=8.0) == 8.0
    assert policy_quiesce_timeout(recovers=True, hang_deadline_s=600.0) == POLICY_QUIESCE_TIMEOUT_S
    assert policy_quiesce_timeout(recovers=False, hang_deadline_s=8.0) == POLICY_QUIESCE_TIMEOUT_S
    assert policy_quiesce_timeout(recovers=True, hang_deadline_s=0.1) == 1.0


def test_lag_is_the_time_since_the_time_rule_made_it_due() -> None:
    s = PolicyState(anchor=100.0)
    assert lag_s(s, 170.0, 60.0) == 10.0  # due at 160, started at 170
    assert lag_s(s, 150.0, 60.0) == 0.0  # the step rule made it due before the interval
    assert lag_s(s, 170.0, None) == 0.0 and lag_s(PolicyState(), 170.0, 60.0) == 0.0
