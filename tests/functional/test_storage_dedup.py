"""Format 2 against real stores (a local directory and SeaweedFS S3): shared, deduplicated
chunks, the gc that reference-counts them, the node's chunk cache, and old snapshots.

Images are made the way CRIU lays memory out: whole pages, areas back to back, so one rank's
weights sit at another offset than its replica's, and a grown area shifts all that follows.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from coordinator.gc import gc_report
from snapshotter.errors import SnapshotCorrupt, StorageUnavailable
from snapshotter.storage import (
    LocalDirStore,
    ObjectStore,
    SnapshotReader,
    SnapshotWriter,
    delete_snapshot,
    list_snapshots,
)
from snapshotter.storage import format as fmt
from snapshotter.storage.cache import CachedStore
from snapshotter.storage.commit import commit_snapshot
from tests.functional.conftest import Backend

pytestmark = pytest.mark.timeout(180)

PAGE = 4096
MiB = 1 << 20


def _weights(mib: int, seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(mib * MiB // 4).astype(np.float32).tobytes()


def _image(root: Path, *, own_pages: int, weights: bytes, seed: int, tail_zero: int = 64) -> Path:
    """A rank's image directory: `own_pages` pages of its own, then the (shared) weights, then
    zero pages, in pages-1.img; a small core file beside."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    own = rng.integers(0, 255, own_pages * PAGE, dtype=np.uint8).tobytes()
    (root / "pages-1.img").write_bytes(own + weights + bytes(tail_zero * PAGE))
    (root / "core-1.img").write_bytes(rng.integers(0, 255, 900, dtype=np.uint8).tobytes())
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _write(store: ObjectStore, sid: str, dirs: dict[str, Path], **kw: object) -> SnapshotWriter:
    with SnapshotWriter(store, sid, chunk_size=4 * MiB, **kw) as w:  # type: ignore[arg-type]
        for name, d in dirs.items():
            w.add_directory(name, d)
        w.commit({"job": "dedup"})
    return w


def _restore(store: ObjectStore, sid: str, tmp: Path) -> dict[str, dict[str, bytes]]:
    """What an agent's thaw does: each stream unpacked as soon as its own chunks verified."""
    r = SnapshotReader(store, sid)
    out = r.fetch_and_extract({n: tmp / "out" / n for n in r.manifest().streams})
    return {n: _tree(p) for n, p in out.items()}


def _stored(store: ObjectStore) -> int:
    return sum(o.size for o in store.list_objects(fmt.CONTENT_PREFIX))


def test_second_snapshot_uploads_only_what_changed(store: ObjectStore, tmp_path: Path) -> None:
    w = _weights(32, 1)
    a = _image(tmp_path / "a", own_pages=40, weights=w, seed=1)
    first = _write(store, "job-0001", {"rank-0": a})
    # The job ran on: its own area grew by 3 pages (everything after shifts) and one page of
    # the weights changed.
    b = _image(tmp_path / "b", own_pages=43, weights=w[:PAGE * 9] + os.urandom(PAGE) +
               w[PAGE * 10:], seed=2)  # fmt: skip
    m1 = SnapshotReader(store, "job-0001").manifest()
    second = _write(store, "job-0002", {"rank-0": b}, seed=m1.streams.values())
    assert second.uploaded_bytes <= 0.1 * first.uploaded_bytes, (
        second.uploaded_bytes, first.uploaded_bytes
    )
    # Without the seed the store itself answers (a HEAD per changed-hash chunk): same bytes.
    third = _write(store, "job-0003", {"rank-0": b})
    assert third.uploaded_bytes == 0
    assert _restore(store, "job-0002", tmp_path / "r2")["rank-0"] == _tree(b)
    assert _restore(store, "job-0001", tmp_path / "r1")["rank-0"] == _tree(a)


def test_data_parallel_replicas_are_stored_once(store: ObjectStore, tmp_path: Path) -> None:
    w = _weights(32, 3)
    one = _image(tmp_path / "one", own_pages=17, weights=w, seed=10)
    _write(store, "solo-0001", {"rank-0": one})
    solo = _stored(store)
    delete_snapshot(store, "solo-0001")
    gc_report(store, set(), now=1e12, min_age_s=0, delete=True)  # back to an empty store
    assert _stored(store) == 0
    # Four replicas on two "nodes" (two writers, as two agents), own areas of other sizes.
    ranks = {f"rank-{r}": _image(tmp_path / f"r{r}", own_pages=17 + 5 * r, weights=w,
                                 seed=20 + r) for r in range(4)}  # fmt: skip
    node_a = SnapshotWriter(store, "dp-0001", chunk_size=4 * MiB)
    node_b = SnapshotWriter(store, "dp-0001", chunk_size=4 * MiB)
    streams: dict[str, dict[str, object]] = {}

    def node(wr: SnapshotWriter, names: list[str]) -> None:
        for n in names:
            streams[n] = wr.add_directory(n, ranks[n]).to_dict()
        wr.release()

    t = [threading.Thread(target=node, args=(node_a, ["rank-0", "rank-1"])),
         threading.Thread(target=node, args=(node_b, ["rank-2", "rank-3"]))]  # fmt: skip
    for x in t:
        x.start()
    for x in t:
        x.join()
    commit_snapshot(store, "dp-0001", streams, {"job": "dp"})  # type: ignore[arg-type]
    assert _stored(store) <= 1.2 * solo, (_stored(store), solo)
    got = _restore(store, "dp-0001", tmp_path / "restored")
    assert got == {n: _tree(p) for n, p in ranks.items()}


def test_old_format_and_mixed_snapshots_still_thaw(store: ObjectStore, tmp_path: Path) -> None:
    a = _image(tmp_path / "a", own_pages=9, weights=_weights(2, 5), seed=5)
    b = _image(tmp_path / "b", own_pages=11, weights=_weights(2, 6), seed=6)
    _write(store, "old-0001", {"rank-0": a, "rank-1": b}, format_version=1)
    m = SnapshotReader(store, "old-0001").manifest()
    assert m.version == 1 and not m.content_keys()
    want = {"rank-0": _tree(a), "rank-1": _tree(b)}
    assert _restore(store, "old-0001", tmp_path / "r-old") == want
    # Agents on both sides of an upgrade: one stream of each format in one snapshot.
    old, new = (SnapshotWriter(store, "mix-0001", format_version=v) for v in (1, 2))
    streams = {"rank-0": old.add_directory("rank-0", a).to_dict(),
               "rank-1": new.add_directory("rank-1", b).to_dict()}  # fmt: skip
    old.release()
    new.release()
    mix = commit_snapshot(store, "mix-0001", streams, {})
    assert mix.version == 2 and mix.content_keys()
    assert _restore(store, "mix-0001", tmp_path / "r-mix") == want


def test_gc_under_a_concurrent_freeze_and_thaw_deletes_nothing_needed(
    store: ObjectStore, tmp_path: Path
) -> None:
    w = _weights(8, 7)
    a = _image(tmp_path / "a", own_pages=5, weights=w, seed=7)
    b = _image(tmp_path / "b", own_pages=6, weights=w, seed=8)
    c = _image(tmp_path / "c", own_pages=7, weights=_weights(4, 9), seed=9)
    _write(store, "gc-0001", {"rank-0": a})
    _write(store, "gc-0002", {"rank-0": b})
    delete_snapshot(store, "gc-0001")  # retention: its own chunks are garbage now
    # A freeze writing (uncommitted: its manifest comes later) and a thaw reading, while gc
    # runs with no grace period at all.
    running = SnapshotWriter(store, "gc-0003", chunk_size=4 * MiB)
    info = running.add_directory("rank-0", c)
    fetched: list[object] = []

    def thaw() -> None:
        try:
            fetched.append(_restore(store, "gc-0002", tmp_path / "thaw"))
        except BaseException as e:  # noqa: BLE001 - asserted below
            fetched.append(e)

    reader = threading.Thread(target=thaw)
    reader.start()
    busy = gc_report(store, {"gc-0003"}, now=1e12, min_age_s=0, delete=True)
    reader.join()
    assert busy["chunks"]["collected"] == 0 and busy["chunks"]["kept"] > 0
    assert fetched == [{"rank-0": _tree(b)}]
    running.commit({})
    assert _restore(store, "gc-0003", tmp_path / "r3")["rank-0"] == _tree(c)
    # Idle: what only gc-0001 used goes; everything gc-0002 and gc-0003 list stays.
    before = {o.key for o in store.list_objects(fmt.CONTENT_PREFIX)}
    report = gc_report(store, set(), now=1e12, min_age_s=0, delete=True)
    after = {o.key for o in store.list_objects(fmt.CONTENT_PREFIX)}
    needed = set().union(*(SnapshotReader(store, s).manifest().content_keys()
                           for s in list_snapshots(store)))  # fmt: skip
    assert report["chunks"]["collected"] == len(before - after) > 0
    assert after == needed and info.raw_size > 0
    # With the default grace period nothing young goes, busy or not.
    delete_snapshot(store, "gc-0003")
    young = gc_report(store, set(), now=time.time(), min_age_s=3600, delete=True)
    assert young["chunks"]["collected"] == 0 and young["chunks"]["kept"] > 0


def test_damaged_shared_chunk_is_caught_and_every_user_named(
    backend: Backend, tmp_path: Path
) -> None:
    store = backend.store
    w = _weights(6, 11)
    _write(store, "bad-0001", {"rank-0": _image(tmp_path / "a", own_pages=3, weights=w, seed=1)})
    _write(store, "bad-0002", {"rank-0": _image(tmp_path / "b", own_pages=4, weights=w, seed=2)})
    shared = (SnapshotReader(store, "bad-0001").manifest().content_keys()
              & SnapshotReader(store, "bad-0002").manifest().content_keys())  # fmt: skip
    victim = sorted(shared)[0]
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 2] ^= 0xFF
    backend.raw_put(victim, bytes(data))
    # A third snapshot whose other stream is intact: all or nothing, no stream is unpacked.
    _write(store, "bad-0003", {"rank-0": _image(tmp_path / "c", own_pages=5, weights=w, seed=3),
                               "rank-1": _image(tmp_path / "d", own_pages=6,
                                                weights=_weights(2, 12), seed=4)})  # fmt: skip
    for sid, other in (("bad-0001", "bad-0002"), ("bad-0002", "bad-0001"),
                       ("bad-0003", "bad-0001")):  # fmt: skip
        with pytest.raises(SnapshotCorrupt) as e:
            _restore(store, sid, tmp_path / f"r-{sid}")
        assert victim in str(e.value) and other in str(e.value)
        assert not (tmp_path / f"r-{sid}" / "out").exists() or not any(
            (tmp_path / f"r-{sid}" / "out").iterdir()
        )
    # A chunk that vanished is named too, and nothing is extracted.
    backend.raw_delete(victim)
    with pytest.raises(SnapshotCorrupt, match="missing"):
        _restore(store, "bad-0001", tmp_path / "r-missing")


def test_node_cache_serves_a_second_thaw_and_drops_a_bad_copy(
    store: ObjectStore, tmp_path: Path
) -> None:
    a = _image(tmp_path / "a", own_pages=8, weights=_weights(4, 12), seed=12)
    _write(store, "cache-0001", {"rank-0": a})
    keys = SnapshotReader(store, "cache-0001").manifest().content_keys()
    cached = CachedStore(store, tmp_path / "cache", 1 << 30)
    assert _restore(cached, "cache-0001", tmp_path / "t1")["rank-0"] == _tree(a)
    assert cached.hits == 0
    assert _restore(cached, "cache-0001", tmp_path / "t2")["rank-0"] == _tree(a)
    assert cached.hits == len(keys)
    # A damaged copy on the node is dropped and fetched again from the store.
    victim = sorted(keys)[0]
    path = tmp_path / "cache" / victim[len(fmt.CONTENT_PREFIX):]
    path.write_bytes(b"SNPn" + b"\x00" * 10)
    assert _restore(cached, "cache-0001", tmp_path / "t3")["rank-0"] == _tree(a)
    assert path.read_bytes() == store.get_bytes(victim)
    # A cache that restarts finds what it held; a small one keeps the newest within its size.
    again = CachedStore(store, tmp_path / "cache", 1 << 30)
    assert _restore(again, "cache-0001", tmp_path / "t4")["rank-0"] == _tree(a)
    assert again.hits == len(keys)
    small = CachedStore(store, tmp_path / "cache", 2 * MiB)
    assert sum(p.stat().st_size for p in (tmp_path / "cache").glob("*/*")) <= 2 * MiB
    assert small.hits == 0


def test_aborted_writer_leaves_no_snapshot_and_gc_reclaims_its_chunks(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    w = SnapshotWriter(store, "ab-0001", chunk_size=4 * MiB)
    w.add_directory("rank-0", _image(tmp_path / "a", own_pages=2, weights=_weights(2, 13), seed=3))
    w.abort()
    assert list_snapshots(store) == [] and _stored(store) > 0
    kept = gc_report(store, set(), now=time.time(), min_age_s=3600, delete=True)
    assert kept["chunks"]["collected"] == 0 and _stored(store) > 0
    gone = gc_report(store, set(), now=1e12, min_age_s=3600, delete=True)
    assert gone["chunks"]["collected"] > 0 and _stored(store) == 0


def test_a_failing_store_never_commits(tmp_path: Path) -> None:
    class Failing(LocalDirStore):
        def put_bytes(self, key: str, data: bytes) -> None:
            if fmt.is_content_key(key) and self.fail:
                raise StorageUnavailable("injected: the store refused a write", "retry")
            super().put_bytes(key, data)

    store = Failing(tmp_path / "store")
    store.fail = True  # type: ignore[attr-defined]
    with pytest.raises(StorageUnavailable, match="injected"):
        _write(store, "fail-0001", {"rank-0": _image(tmp_path / "a", own_pages=2,
                                                     weights=_weights(1, 14), seed=4)})  # fmt: skip
    assert list_snapshots(store) == []


def test_the_coordinator_sweeps_what_retention_left_and_waits_for_freezes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapshotter.coordinator.core import Coordinator
    from snapshotter.coordinator.supervisor import Supervisor

    monkeypatch.setenv("SNAPSHOTTER_GC_INTERVAL_S", "1")
    store = LocalDirStore(tmp_path / "store")
    w = _weights(4, 15)
    _write(store, "ret-0001", {"rank-0": _image(tmp_path / "a", own_pages=3, weights=w, seed=1)})
    _write(store, "ret-0002", {"rank-0": _image(tmp_path / "b", own_pages=4, weights=w, seed=2)})
    delete_snapshot(store, "ret-0001")  # what retention does: the manifest goes, chunks stay
    old = time.time() - 2 * 3600  # older than gc's grace period
    for p in (tmp_path / "store" / "chunks").rglob("*"):
        os.utime(p, (old, old))
    before = _stored(store)
    coord = Coordinator(store, f"file://{tmp_path / 'store'}", lambda address, name: None)  # type: ignore[arg-type,return-value]
    clock = [1000.0]
    sup = Supervisor(coord, clock=lambda: clock[0])
    clock[0] += 1  # an interval after start

    def sweep() -> None:
        sup._maybe_sweep()
        deadline = time.monotonic() + 30
        while sup._sweeping and time.monotonic() < deadline:
            time.sleep(0.05)

    coord.writing.add("ret-0003")  # a freeze is writing: no sweep
    sweep()
    assert _stored(store) == before
    coord.writing.clear()
    sweep()
    assert 0 < _stored(store) < before
    assert _restore(store, "ret-0002", tmp_path / "r")["rank-0"] == _tree(tmp_path / "b")


def test_commit_asks_only_for_chunks_it_did_not_put_and_catches_a_vanished_one(
    tmp_path: Path,
) -> None:
    class Counting(LocalDirStore):
        heads: list[str] = []

        def head(self, key: str) -> int | None:
            self.heads.append(key)
            return super().head(key)

    store = Counting(tmp_path / "store")
    w = _weights(8, 16)
    first = _write(store, "cnt-0001", {"rank-0": _image(tmp_path / "a", own_pages=5, weights=w,
                                                         seed=1)})  # fmt: skip
    m1 = SnapshotReader(store, "cnt-0001").manifest()
    keys = {c.key for _, c in m1.chunks()}
    assert set(first.put_keys) == keys
    # Each chunk was asked for once, by the writer before its PUT; the commit asked for none.
    assert sorted(k for k in store.heads if fmt.is_content_key(k)) == sorted(keys)

    # A second snapshot takes unchanged chunks from the first without a request: the commit
    # asks for those, and refuses when one vanished meanwhile (gc of a deleted snapshot).
    store.heads.clear()
    b = _image(tmp_path / "b", own_pages=6, weights=w, seed=2)
    with SnapshotWriter(store, "cnt-0002", chunk_size=4 * MiB, seed=m1.streams.values()) as w2:
        info = w2.add_directory("rank-0", b)
        seeded = [c.key for c in info.chunks if c.key not in w2.put_keys]
        assert seeded
        store.delete_keys([seeded[0]])
        with pytest.raises(StorageUnavailable, match="missing"):
            w2.commit({"job": "dedup"})
    assert list_snapshots(store) == ["cnt-0001"]
    assert seeded[0] in store.heads


def test_a_signed_commit_writes_its_signature_first_and_readers_hold_to_the_checked_bytes(
    tmp_path: Path,
) -> None:
    from snapshotter.errors import SnapshotUntrusted
    from snapshotter.storage import signing

    class Recording(LocalDirStore):
        puts: list[str] = []

        def put_bytes(self, key: str, data: bytes) -> None:
            self.puts.append(key)
            super().put_bytes(key, data)

    store = Recording(tmp_path / "store")
    signer, ring = signing.load(tmp_path / "keys")
    a = _image(tmp_path / "a", own_pages=3, weights=_weights(2, 17), seed=1)
    with SnapshotWriter(store, "sig-0001", chunk_size=4 * MiB) as w:
        w.add_directory("rank-0", a)
        w.commit({"job": "sig"}, signer=signer)
    assert store.puts[-2:] == [fmt.signature_key("sig-0001"), fmt.manifest_key("sig-0001")]
    r = SnapshotReader(store, "sig-0001")
    body = r.manifest_body()
    assert ring.verify("sig-0001", body, r.signature()) == signer.key_id
    good = signing.manifest_digest(body)
    assert SnapshotReader(store, "sig-0001", digest=good).manifest().streams
    # The manifest replaced after the coordinator checked it: the agent's reader refuses.
    store.put_bytes(fmt.manifest_key("sig-0001"), body.replace(b'"sig"', b'"SIG"'))
    with pytest.raises(SnapshotUntrusted, match="changed after"):
        SnapshotReader(store, "sig-0001", digest=good).manifest()
    # Deleting the snapshot removes its signature too.
    delete_snapshot(store, "sig-0001")
    assert not any(store.list_keys(fmt.snapshot_prefix("sig-0001")))
