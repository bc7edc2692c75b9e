"""Coordinator decisions: pure functions, no processes."""

from datetime import UTC, datetime

import pytest

from snapshotter import errors
from snapshotter.coordinator.decisions import (
    JobPhase,
    exit_code,
    job_phase,
    pick_targets,
    place,
    snapshot_id,
    supervised_phase,
    thaw_job_id,
)


def test_targets_are_one_past_the_max_per_group() -> None:
    counts = {0: {"0": 10, "1": 3}, 1: {"0": 12, "1": 3}, 2: {"0": 11}}
    assert pick_targets(counts) == {"0": 13, "1": 4}


def test_targets_with_no_groups_is_empty() -> None:
    assert pick_targets({0: {}, 1: {}}) == {}


def test_snapshot_id_is_sortable_and_utc() -> None:
    t = datetime(2026, 11, 30, 14, 1, 2, tzinfo=UTC)
    assert snapshot_id("job-a", t, "ab12") == "job-a-20261130T140102-ab12"


def test_thaw_keeps_id_when_source_is_not_running() -> None:
    assert thaw_job_id("j", None, active=[], known=["j"]) == "j"


def test_thaw_forks_when_source_runs() -> None:
    assert thaw_job_id("j", None, active=["j"], known=["j", "j.1"]) == "j.2"


def test_thaw_explicit_id_must_not_be_active() -> None:
    with pytest.raises(errors.InvalidArgument):
        thaw_job_id("j", "k", active=["k"], known=["k"])
    assert thaw_job_id("j", "k", active=["j"], known=["j"]) == "k"


@pytest.mark.parametrize(
    ("busy", "states", "want"),
    [
        ("FREEZING", ["RUNNING"], JobPhase.FREEZING),
        (None, ["RUNNING", "RUNNING"], JobPhase.RUNNING),
        (None, ["SUCCEEDED", "SUCCEEDED"], JobPhase.SUCCEEDED),
        (None, ["FAILED", "SUCCEEDED"], JobPhase.FAILED),
        (None, ["FROZEN"], JobPhase.FROZEN),
        (None, ["FAILED", "RUNNING"], JobPhase.RUNNING),
        (None, [], JobPhase.FAILED),
        (None, ["UNREACHABLE"], JobPhase.RUNNING),
        (None, ["UNREACHABLE", "SUCCEEDED"], JobPhase.RUNNING),
        (None, ["UNREACHABLE", "FAILED"], JobPhase.FAILED),
    ],
)
def test_job_phase(busy: str | None, states: list[str], want: JobPhase) -> None:
    assert job_phase(busy, states) is want


R, F, C = JobPhase.RUNNING, JobPhase.FAILED, JobPhase.CANCELLED


@pytest.mark.parametrize(
    ("phase", "busy", "recovers", "recovering", "gave_up", "cancelled", "want"),
    [
        (R, None, True, False, False, False, R),
        (F, None, True, False, False, False, JobPhase.RECOVERING),
        # A freeze that lost a node stopped the job's other ranks: recovered, not over.
        (C, None, True, False, False, False, JobPhase.RECOVERING),
        (C, None, True, False, False, True, C),  # a person cancelled it
        (C, None, False, False, False, False, C),  # no --recover auto
        (F, None, False, False, False, False, F),
        (C, None, True, False, True, False, F),  # recovery gave up and stopped the rest
        (F, None, True, False, True, False, F),
        (R, None, True, True, False, False, JobPhase.RECOVERING),  # a recovery is under way
        (JobPhase.THAWING, "THAWING", True, True, False, False, JobPhase.THAWING),
        (JobPhase.SUCCEEDED, None, True, False, False, False, JobPhase.SUCCEEDED),
        (JobPhase.FROZEN, None, True, False, False, False, JobPhase.FROZEN),
    ],
)
def test_supervised_phase(
    phase: JobPhase, busy: str | None, recovers: bool, recovering: bool, gave_up: bool,
    cancelled: bool, want: JobPhase,
) -> None:  # fmt: skip
    assert supervised_phase(phase, busy, recovers, recovering, gave_up, cancelled) is want


def test_exit_code_is_first_failing_rank() -> None:
    assert exit_code(JobPhase.FAILED, [0, None, 3, 4]) == 3
    assert exit_code(JobPhase.SUCCEEDED, [0, 0]) == 0
    assert exit_code(JobPhase.FROZEN, [None, -9]) == 0
    assert exit_code(JobPhase.CANCELLED, [None]) == 1


def test_a_recovery_event_says_where_its_time_went() -> None:
    from snapshotter.coordinator.recover import phase_times
    from snapshotter.v1 import coordinator_pb2 as cpb

    stats = cpb.ThawStats(fetch_s=0.84, restore_s=2.5, total_s=3.62, nodes=[
        cpb.NodeThawStats(node="a", restore_s=1.2, resume_s=0.31),
        cpb.NodeThawStats(node="b", restore_s=1.6, resume_s=0.2),
    ])  # fmt: skip
    assert phase_times(0.26, stats) == (
        "stop 0.3s, thaw 3.6s (fetch 0.8s, restore 1.6s, resume 0.3s)"
    )
    assert phase_times(0.26, None) == "stop 0.3s"  # relaunched from the start: no thaw


def test_agents_are_asked_to_beat_less_often_as_they_grow_and_live_longer_for_it() -> None:
    from snapshotter.coordinator.decisions import LOST_AFTER_BEATS, beat_interval, lost_after

    assert beat_interval(64, 512) == 0.125  # below the agents' own 2 s: they keep theirs
    assert beat_interval(2048, 512) == 4.0
    assert beat_interval(16384, 512) == 32.0
    assert beat_interval(2048, 0) == 0.0  # no bound
    assert lost_after(15.0, 2.0) == 15.0  # the configured ttl while intervals are short
    assert lost_after(15.0, 32.0) == LOST_AFTER_BEATS * 32.0  # never before 3 missed beats


LIVE = [f"n{i:05d}" for i in range(2048)]


def test_place_takes_the_nodes_asked_for_in_order_or_the_first_live_ones() -> None:
    assert place(2, ["n00007", "n00003"], LIVE) == ["n00007", "n00003"]
    assert place(3, [], reversed(LIVE)) == ["n00000", "n00001", "n00002"]
    # A job of 16,384 nodes named one by one (the check of repeats is one pass).
    many = [f"m{i:05d}" for i in range(16384)]
    assert place(len(many), many, many) == many


def test_place_names_a_few_unknown_nodes_and_how_many_more() -> None:
    asked = [f"gone{i}" for i in range(1000)] + ["n00001"]
    with pytest.raises(errors.InvalidArgument) as e:
        place(len(asked), asked, LIVE)
    assert e.value.cause == (
        "1000 unknown or unreachable node(s): gone0, gone1, gone2, gone3, gone4, gone5, gone6, "
        "gone7, ... and 992 more"
    )
    assert e.value.next_step.startswith("live nodes (2048): n00000, n00001, ")
    assert e.value.next_step.endswith(", ... and 2040 more")


def test_place_refuses_a_node_named_twice_and_too_few_nodes() -> None:
    with pytest.raises(errors.InvalidArgument, match=r"node\(s\) n00001 named more than once"):
        place(3, ["n00001", "n00002", "n00001"], LIVE)
    with pytest.raises(errors.InvalidArgument, match="needs 3 node.*2 were given"):
        place(3, ["n00001", "n00002"], LIVE)
    with pytest.raises(errors.ServiceUnavailable, match="no node agent"):
        place(1, [], [])


def test_few_shows_at_most_its_limit_and_counts_the_rest() -> None:
    assert errors.few([]) == ""
    assert errors.few([1, 2, 3], limit=3) == "1, 2, 3"
    assert errors.few(iter(range(5)), limit=2, sep="; ") == "0; 1; ... and 3 more"
