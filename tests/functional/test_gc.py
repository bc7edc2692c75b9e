"""gc of orphaned snapshots on real stores: a local directory and a real SeaweedFS S3 server.

Orphans are made the way production makes them: a SnapshotWriter that uploaded chunks and was
never committed nor aborted (its coordinator was killed). Time is controlled through gc's `now`
(the objects' own write times are real), never by sleeping.
"""

from __future__ import annotations

import io
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import snapshotter.coordinator.gc as gc
from snapshotter.storage import (
    LocalDirStore,
    ObjectStore,
    S3Store,
    SnapshotReader,
    SnapshotWriter,
    find_orphans,
    list_snapshots,
)
from snapshotter.storage import format as fmt
from tests.support.seaweed import SeaweedServer, seaweed_server  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(180)

KiB = 1024
HOUR = 3600.0


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalDirStore(tmp_path / "store")
    server: SeaweedServer = request.getfixturevalue("seaweed_server")
    return S3Store(server.bucket, f"gc-tests/{uuid.uuid4().hex[:12]}", **server.store_kwargs())


def _sid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _committed(store: ObjectStore, tag: str = "done") -> str:
    sid = _sid(tag)
    with SnapshotWriter(store, sid, chunk_size=64 * KiB, workers=2) as w:
        w.write_stream("rank-0", io.BytesIO(os.urandom(150 * KiB)))
        w.commit({"job": "j"})
    return sid


def _uncommitted(store: ObjectStore, tag: str) -> tuple[SnapshotWriter, int]:
    """A freeze that uploaded its chunks and went no further (killed, or still going)."""
    w = SnapshotWriter(store, _sid(tag), chunk_size=64 * KiB, workers=2)
    info = w.write_stream("rank-0", io.BytesIO(os.urandom(200 * KiB)))
    return w, info.stored_size


def _by_id(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["snapshot_id"]: o for o in report["orphans"]}


def _keys(store: ObjectStore, sid: str) -> list[str]:
    return list(store.list_keys(fmt.snapshot_prefix(sid)))


@pytest.mark.usefixtures("format_1")
def test_gc_collects_only_old_orphans_not_in_progress(store: ObjectStore, tmp_path: Path) -> None:
    done = _committed(store)
    killed, killed_bytes = _uncommitted(store, "killed")
    running, _ = _uncommitted(store, "running")
    in_progress = {running.snapshot_id}
    orphan_ids = sorted([killed.snapshot_id, running.snapshot_id])
    assert sorted(find_orphans(store)) == orphan_ids

    # Just written: both are within the grace period; nothing is collectable.
    r = gc.gc_report(store, in_progress, now=time.time(), min_age_s=HOUR, delete=True)
    assert [o["snapshot_id"] for o in r["orphans"]] == orphan_ids  # never the committed one
    k = _by_id(r)[killed.snapshot_id]
    assert (k["objects"], k["bytes"], k["action"]) == (4, killed_bytes, gc.KEPT)
    assert 0 <= k["newest_age_s"] < 120 and "grace period" in k["reason"]
    assert _by_id(r)[running.snapshot_id]["reason"] == gc.IN_PROGRESS
    assert r["summary"]["collected"] == 0 and r["summary"]["kept"] == 2
    assert len(_keys(store, killed.snapshot_id)) == 4

    # Two hours on, a dry run: the killed freeze is collectable, the running one is kept.
    later = time.time() + 2 * HOUR
    r = gc.gc_report(store, in_progress, now=later, min_age_s=HOUR, delete=False)
    assert {s: o["action"] for s, o in _by_id(r).items()} == {
        killed.snapshot_id: gc.COLLECTABLE,
        running.snapshot_id: gc.KEPT,
    }
    assert r["summary"]["collected_bytes"] == killed_bytes and not r["delete"]
    assert len(_keys(store, killed.snapshot_id)) == 4  # a dry run deletes nothing

    r = gc.gc_report(store, in_progress, now=later, min_age_s=HOUR, delete=True)
    assert _by_id(r)[killed.snapshot_id]["action"] == gc.DELETED
    assert _by_id(r)[killed.snapshot_id]["failed_keys"] == []
    assert r["summary"] == {
        "orphans": 2,
        "objects": 8,
        "bytes": r["summary"]["bytes"],
        "kept": 1,
        "collected": 1,
        "collected_bytes": killed_bytes,
        "failed": 0,
        "failed_keys": 0,
    }
    assert _keys(store, killed.snapshot_id) == []
    assert find_orphans(store) == [running.snapshot_id]
    assert list_snapshots(store) == [done]
    assert SnapshotReader(store, done).verify_and_fetch(tmp_path / "st1")

    # The freeze gc left alone finishes and its snapshot is whole.
    running.commit({"job": "j"})
    assert SnapshotReader(store, running.snapshot_id).verify_and_fetch(tmp_path / "st2")
    r = gc.gc_report(store, set(), now=later, min_age_s=HOUR, delete=True)
    assert r["orphans"] == [] and r["summary"]["orphans"] == 0
    assert sorted(list_snapshots(store)) == sorted([done, running.snapshot_id])


@pytest.mark.usefixtures("format_1")
def test_snapshot_committed_while_gc_runs_is_not_deleted(
    store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A freeze by another coordinator, stalled past the grace period, commits right after gc
    # decided to collect it.
    slow, _ = _uncommitted(store, "slow")
    decide = gc.collectable

    def decide_then_commit(*args: Any) -> tuple[list[str], dict[str, str]]:
        out = decide(*args)
        slow.commit({"job": "j"})
        return out

    monkeypatch.setattr(gc, "collectable", decide_then_commit)
    r = gc.gc_report(store, set(), now=time.time() + 2 * HOUR, min_age_s=HOUR, delete=True)
    entry = _by_id(r)[slow.snapshot_id]
    assert (entry["action"], entry["reason"]) == (gc.KEPT, gc.COMMITTED_MEANWHILE)
    assert list_snapshots(store) == [slow.snapshot_id]
    assert SnapshotReader(store, slow.snapshot_id).verify_and_fetch(tmp_path / "st")


def _backdate(root: Path, sid: str, seconds: float) -> None:
    for p in (root / fmt.snapshot_prefix(sid)).rglob("*"):
        st = p.stat()
        os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds))


@pytest.mark.usefixtures("format_1")
def test_mixed_ages_in_one_pass_local(tmp_path: Path) -> None:
    """Ages set on the files themselves (S3 cannot backdate an object), judged at real now."""
    root = tmp_path / "store"
    store = LocalDirStore(root)
    done = _committed(store)
    old, _ = _uncommitted(store, "old")
    young, _ = _uncommitted(store, "young")
    running, _ = _uncommitted(store, "running")
    # A delete that removed the manifest and then failed on the chunks: an orphan too.
    half = _committed(store, "half")
    (root / fmt.manifest_key(half)).unlink()
    for sid in (old.snapshot_id, running.snapshot_id, half):
        _backdate(root, sid, 3 * HOUR)

    r = gc.gc_report(store, {running.snapshot_id}, now=time.time(), min_age_s=HOUR, delete=True)
    assert {s: o["action"] for s, o in _by_id(r).items()} == {
        old.snapshot_id: gc.DELETED,
        half: gc.DELETED,
        young.snapshot_id: gc.KEPT,
        running.snapshot_id: gc.KEPT,
    }
    assert 3 * HOUR <= _by_id(r)[old.snapshot_id]["newest_age_s"] < 3 * HOUR + 120
    assert sorted(find_orphans(store)) == sorted([young.snapshot_id, running.snapshot_id])
    assert not (root / fmt.snapshot_prefix(old.snapshot_id)).exists()
    assert list_snapshots(store) == [done]
    assert SnapshotReader(store, done).verify_and_fetch(tmp_path / "st")


def test_bad_min_age_is_refused_before_listing(tmp_path: Path) -> None:
    from snapshotter.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        gc.gc_report(LocalDirStore(tmp_path / "s"), set(), now=0.0, min_age_s=-1.0)
