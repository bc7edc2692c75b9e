"""Failure detection and recovery decisions as pure functions (coordinator/detect.py,
coordinator/decisions.py): no processes, no clocks."""

from __future__ import annotations

import signal

import pytest

from snapshotter import errors
from snapshotter.coordinator import detect
from snapshotter.coordinator.decisions import may_recover, recovery_nodes
from snapshotter.coordinator.detect import RankSample


def test_the_rank_that_failed_first_is_blamed_not_the_peers_its_agent_ended() -> None:
    # rank 1 was killed; the agent then ended rank 0 with SIGTERM and rank 0's exit is lower.
    f = detect.rank_failure({0: -signal.SIGTERM, 1: 137}, first=[1])
    assert f is not None and f.rank == 1 and f.cause == "rank_signal" and "SIGKILL" in f.detail
    # Without the agent's word, a rank that did not end by the agent's signals is preferred.
    f = detect.rank_failure({0: -signal.SIGTERM, 1: 3})
    assert f is not None and f.rank == 1 and f.cause == "rank_exit" and "code 3" in f.detail
    assert detect.rank_failure({0: None, 1: 0}) is None
    assert detect.rank_failure({0: 0, 1: 0}) is None


def test_lost_nodes_are_the_job_nodes_without_a_live_agent() -> None:
    assert detect.lost_nodes(["a", "b", "c"], ["a", "c", "d"]) == ["b"]
    assert detect.lost_nodes(["a", ""], ["a"]) == []  # a node not re-learned yet is not lost


def _s(rank: int, n: int, answered: bool = True, state: str = "S") -> RankSample:
    return RankSample(rank=rank, answered=answered, counts={"g": n}, steps=n, proc_state=state)


def test_a_hang_is_nothing_completed_for_the_deadline_and_names_the_stopped_rank() -> None:
    p = detect.observe(detect.Progress(), [_s(0, 10), _s(1, 10)], now=0.0)
    p = detect.observe(p, [_s(0, 11), _s(1, 11)], now=5.0)
    assert p.steps == 11
    # rank 1 is stopped: it answers nothing; rank 0 blocks in its collective.
    stuck = [_s(0, 12), _s(1, 11, answered=False, state="T")]
    p = detect.observe(p, stuck, now=6.0)
    # Rank 0 issued its 12th, which cannot complete: nothing completed since 5.0.
    assert detect.hang(p, stuck, now=14.0, deadline_s=10.0) is None  # 9 s without progress
    f = detect.hang(p, stuck, now=15.5, deadline_s=10.0)
    assert f is not None and f.cause == "hang" and f.rank == 1 and f.detect_s == pytest.approx(10.5)
    # A freeze (or thaw) restarts the clocks: holding collectives on purpose is no hang.
    p = detect.reset(p, now=16.5)
    assert detect.hang(p, stuck, now=20.0, deadline_s=10.0) is None


def test_one_rank_issuing_ahead_of_a_stuck_peer_is_no_progress() -> None:
    """A collective completes only when every member issued it: rank 0 issuing its next one
    (as a parked rank does when a freeze gives up) while rank 1 stays put is no progress, and
    rank 1 is the one the others wait for."""
    p = detect.observe(detect.Progress(), [_s(0, 5), _s(1, 5)], now=0.0)
    p = detect.observe(p, [_s(0, 6), _s(1, 5)], now=8.0)
    assert detect.stalled_for(p, now=8.0) == 8.0
    assert detect.hang(p, [_s(0, 6), _s(1, 5)], now=9.0, deadline_s=10.0) is None
    f = detect.hang(p, [_s(0, 6), _s(1, 5)], now=10.5, deadline_s=10.0)
    assert f is not None and f.rank == 1 and "no collective completed for 10s" in f.detail
    assert detect.behind_rank([_s(0, 6), _s(1, 5)]) == 1
    assert detect.behind_rank([_s(0, 6), _s(1, 6)]) is None


def test_the_laggard_catching_up_is_progress() -> None:
    p = detect.observe(detect.Progress(), [_s(0, 5), _s(1, 5)], now=0.0)
    p = detect.observe(p, [_s(0, 6), _s(1, 5)], now=5.0)
    p = detect.observe(p, [_s(0, 6), _s(1, 6)], now=9.0)
    assert detect.stalled_for(p, now=12.0) == 3.0
    assert detect.hang(p, [_s(0, 6), _s(1, 6)], now=18.0, deadline_s=10.0) is None


def test_completed_is_per_group_over_the_members_that_report_it() -> None:
    """A group only some ranks belong to (a pipeline stage pair, a sub-group) completes at
    the fewest its own members issued."""
    seen = {0: ((("dp", 7), ("pp", 3)), 2), 1: ((("dp", 6),), 2), 2: ((("pp", 4),), 1)}
    assert detect.frontier(seen) == ((("dp", 6), ("pp", 3)), 1)


def test_last_traceback_is_the_final_block_without_torchs_rank_prefix() -> None:
    log = "\n".join([
        "step 1", "Traceback (most recent call last):", '  File "a.py", line 1', "OldError: x",
        "step 2", "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 9, in <module>', "[rank1]:     boom()",
        "[rank1]: RuntimeError: injected bug", "[rank1]: more noise",
    ])  # fmt: skip
    tb = detect.last_traceback(log)
    assert tb.splitlines()[0] == "Traceback (most recent call last):"
    assert tb.splitlines()[-1] == "RuntimeError: injected bug"
    assert "OldError" not in tb and "[rank1]" not in tb
    assert detect.last_traceback("a\nb\nc") == "a\nb\nc"  # no traceback: the last lines


def test_recovery_keeps_healthy_nodes_and_replaces_lost_ones_by_spares_first() -> None:
    live = ["a", "b", "c", "spare"]
    assert recovery_nodes(["a", "b"], [], live, []) == ["a", "b"]  # a rank died: same nodes
    assert recovery_nodes(["a", "b"], ["b"], ["a", "c", "spare"], ["spare"]) == ["a", "spare"]
    assert recovery_nodes(["a", "b"], ["b"], ["a", "c"], ["spare"]) == ["a", "c"]
    # A draining node is avoided like a failed one.
    assert recovery_nodes(["a", "b"], [], live, ["spare"], avoid=["a"]) == ["spare", "b"]
    with pytest.raises(errors.ServiceUnavailable, match="no healthy node"):
        recovery_nodes(["a", "b"], ["b"], ["a"], [])


def test_recoveries_are_limited_within_the_window() -> None:
    assert may_recover([], now=100.0, max_tries=2, window_s=60.0)
    assert may_recover([50.0], now=100.0, max_tries=2, window_s=60.0)
    assert not may_recover([50.0, 90.0], now=100.0, max_tries=2, window_s=60.0)
    assert may_recover([10.0, 30.0], now=100.0, max_tries=2, window_s=60.0)  # both outside


def test_ranks_that_never_answer_are_no_hang() -> None:
    """Ranks whose hook predates the progress query (thawed from an old snapshot) are silent."""
    silent = [_s(0, 0, answered=False), _s(1, 0, answered=False)]
    p = detect.observe(detect.Progress(), silent, now=0.0)
    p = detect.observe(p, silent, now=100.0)
    assert not p.answering
    assert detect.hang(p, silent, now=1000.0, deadline_s=10.0) is None


def test_start_up_before_the_first_collective_is_no_hang() -> None:
    """The ranks answer from the moment the hook is in, long before a large job's first
    collective (imports, data, model build; slower still on a busy node)."""
    starting = [RankSample(rank=r, answered=True, counts={}, steps=0) for r in (0, 1)]
    p = detect.observe(detect.Progress(), starting, now=0.0)
    p = detect.observe(p, starting, now=50.0)
    assert p.answering and detect.hang(p, starting, now=100.0, deadline_s=10.0) is None
    # From the first collective on, the deadline counts.
    began = [RankSample(rank=r, answered=True, counts={"g": 1}, steps=0) for r in (0, 1)]
    p = detect.observe(p, began, now=101.0)
    assert detect.hang(p, began, now=105.0, deadline_s=10.0) is None
    f = detect.hang(p, began, now=112.0, deadline_s=10.0)
    assert f is not None and f.cause == "hang"
