"""A job's life kept in the store (coordinator/journal.py): what a restarted coordinator reads
back is what the previous one had, written only when it changed, and a damaged or foreign
object costs the history, never an exception."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from snapshotter.coordinator import journal
from snapshotter.coordinator.journal import Journal
from snapshotter.coordinator.life import JobLife
from snapshotter.storage.local import LocalDirStore


def _life() -> JobLife:
    life = JobLife()
    life.add("snapshot", snapshot_id="j-1", took_s=3.5)
    life.add("failure", cause="rank_signal", rank=1, detect_s=0.4, detail="rank 1: SIGKILL")
    life.add("recovered", snapshot_id="j-1", steps_lost=12, nodes=["a", "c"])
    life.recoveries = [1_800_000_000.5]
    life.stalls.extend([1.5, 2.0])
    life.snapshot_steps = {"j-1": 40}
    life.gave_up = ""
    life.last_traceback = "Traceback (most recent call last):\n  ...\nRuntimeError: boom"
    return life


def test_what_is_read_back_is_what_was_kept() -> None:
    life = _life()
    back = journal.load("job-x", journal.dump("job-x", life))
    assert list(back.events) == list(life.events)
    assert back.events[1].rank == 1 and back.events[2].nodes == ["a", "c"]
    assert back.recoveries == life.recoveries and list(back.stalls) == [1.5, 2.0]
    assert back.snapshot_steps == {"j-1": 40} and back.last_traceback == life.last_traceback
    assert back.cancelled is False and back.gave_up == ""
    assert back.changes == 0 and not back.busy()  # this process's state starts afresh


@pytest.mark.parametrize(
    "doc",
    [
        {"format": 1, "job_id": "other-job"},  # another job's
        {"format": 2, "job_id": "job-x"},  # a newer format
        {"format": 1, "job_id": "job-x", "events": [{"rank": "one"}]},
        {"format": 1, "job_id": "job-x", "events": "nope"},
        {"format": 1, "job_id": "job-x", "recoveries": ["yesterday"]},
        {"format": 1, "job_id": "job-x", "snapshot_steps": [1, 2]},
        {"format": 1, "job_id": "job-x", "gave_up": 7},
        [],
    ],
)
def test_a_foreign_or_damaged_object_is_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        journal.load("job-x", json.dumps(doc).encode())


def test_written_when_changed_read_back_and_forgotten(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    j = Journal(store)
    j.save_changed([("quiet-job", JobLife())])  # no events: nothing in the store
    assert store.head(journal.key_of("quiet-job")) is None
    life = _life()
    j.save_changed([("job-x", life)])
    key = journal.key_of("job-x")
    first = store.get_bytes(key)

    # Nothing changed: nothing written (the object is not rewritten, even if it was altered).
    store.put_bytes(key, first.replace(b"rank 1: SIGKILL", b"rank 1: SIGKILX"))
    j.save_changed([("job-x", life)])
    assert b"SIGKILX" in store.get_bytes(key)
    life.add("snapshot", snapshot_id="j-2")  # a change: written again
    j.save_changed([("job-x", life)])
    assert b"j-2" in store.get_bytes(key) and b"SIGKILX" not in store.get_bytes(key)

    # A new coordinator on the same store.
    back = Journal(store).read("job-x")
    assert back is not None and [e.kind for e in back.events][-1] == "snapshot"
    assert back.recoveries == life.recoveries
    assert Journal(store).read("never-seen") is None

    store.put_bytes(key, b"{not json")
    assert Journal(store).read("job-x") is None  # unusable: the job starts with no history

    j.forget(["job-x"])
    assert store.head(key) is None
