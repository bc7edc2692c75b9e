"""gc decisions: which orphaned snapshots may be collected. Pure functions, no store."""

import math

import pytest

from snapshotter import errors
from snapshotter.coordinator.gc import BUSY, IN_PROGRESS, check_min_age, collectable, sweepable

NOW = 1_800_000_000.0
HOUR = 3600.0


def test_old_orphans_are_collected_sorted() -> None:
    orphans = {"b": NOW - 2 * HOUR, "a": NOW - 5 * HOUR}
    assert collectable(orphans, set(), NOW, HOUR) == (["a", "b"], {})


def test_young_orphan_is_kept_with_its_age() -> None:
    collect, kept = collectable({"young": NOW - 59.0, "old": NOW - HOUR}, set(), NOW, HOUR)
    assert collect == ["old"]
    assert list(kept) == ["young"]
    assert "59s old" in kept["young"] and "3600s grace" in kept["young"]


def test_age_exactly_min_age_is_collected() -> None:
    assert collectable({"x": NOW - HOUR}, set(), NOW, HOUR)[0] == ["x"]
    assert collectable({"x": NOW - HOUR + 0.001}, set(), NOW, HOUR)[0] == []


def test_in_progress_is_kept_however_old() -> None:
    collect, kept = collectable({"x": NOW - 100 * HOUR, "y": NOW - 100 * HOUR}, {"x"}, NOW, 0.0)
    assert collect == ["y"] and kept == {"x": IN_PROGRESS}


def test_in_progress_ids_that_are_not_orphans_are_ignored() -> None:
    assert collectable({"x": NOW - 2 * HOUR}, {"other"}, NOW, HOUR) == (["x"], {})


def test_object_from_the_future_is_kept() -> None:
    # The store's clock runs ahead of ours: a negative age is never old enough.
    collect, kept = collectable({"x": NOW + 30.0}, set(), NOW, 0.0)
    assert collect == [] and "0s old" in kept["x"]


def test_zero_min_age_collects_everything_not_in_progress() -> None:
    assert collectable({"x": NOW, "y": NOW - 1}, {"y"}, NOW, 0.0) == (["x"], {"y": IN_PROGRESS})


def test_no_orphans() -> None:
    assert collectable({}, {"x"}, NOW, HOUR) == ([], {})


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_min_age_is_refused(bad: float) -> None:
    with pytest.raises(errors.InvalidArgument, match="min-age"):
        collectable({"x": NOW}, set(), NOW, bad)
    with pytest.raises(errors.InvalidArgument):
        check_min_age(bad)


def test_shared_chunks_swept_only_when_unreferenced_old_and_idle() -> None:
    chunks = {"chunks/aa/a": 100.0, "chunks/bb/b": 100.0, "chunks/cc/c": 990.0}
    go, kept, why = sweepable(chunks, {"chunks/aa/a"}, busy=False, now=1000.0, min_age_s=60)
    assert go == ["chunks/bb/b"] and kept == 1 and "60s" in why
    go, kept, why = sweepable(chunks, set(), busy=True, now=1000.0, min_age_s=0)
    assert go == [] and kept == 3 and why == BUSY
    assert sweepable(chunks, set(chunks), busy=True, now=1e9, min_age_s=0) == ([], 0, "")
