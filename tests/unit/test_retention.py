"""What a long-running agent keeps and lets go (agent/retention.py): pure decisions."""

from __future__ import annotations

from snapshotter.agent.retention import dirs_to_prune, expired, jobs_to_forget


def test_only_the_newest_finished_jobs_are_kept() -> None:
    finished = {f"j{i}": float(i) for i in range(10)}
    assert jobs_to_forget(finished, now=10.0, keep=3, max_age_s=1e9) == [f"j{i}" for i in range(7)]
    assert jobs_to_forget(finished, now=10.0, keep=10, max_age_s=1e9) == []
    assert jobs_to_forget(finished, now=10.0, keep=0, max_age_s=1e9) == sorted(finished)


def test_old_finished_jobs_go_whatever_the_count() -> None:
    finished = {"old": 0.0, "recent": 95.0, "new": 99.0}
    assert jobs_to_forget(finished, now=100.0, keep=100, max_age_s=10.0) == ["old"]


def test_ties_are_broken_by_id_so_the_choice_is_stable() -> None:
    assert jobs_to_forget({"b": 1.0, "a": 1.0, "c": 1.0}, 2.0, 1, 1e9) == ["a", "b"]


def test_directories_in_use_are_never_pruned_and_count_against_keep() -> None:
    dirs = {"d1": 1.0, "d2": 2.0, "d3": 3.0, "live": 0.5}
    # Keep 2: the live one is one of them, so only the newest other survives.
    assert dirs_to_prune(dirs, keep=2, in_use={"live"}) == ["d1", "d2"]
    assert dirs_to_prune(dirs, keep=10, in_use=set()) == []
    assert dirs_to_prune(dirs, keep=0, in_use={"live"}) == ["d1", "d2", "d3"]


def test_expiry_is_strictly_older_than_the_ttl() -> None:
    assert expired({"a": 0.0, "b": 5.0, "c": 10.0}, now=15.0, ttl_s=10.0) == ["a"]
    assert expired({}, now=1.0, ttl_s=0.0) == []
