"""One suite, every object-store backend: a local directory and a real SeaweedFS S3 server.

Each test gets a fresh store (a new directory, or a new prefix in the test bucket) and talks
to the backend the way production does. "Backend" operations that bypass snapshotter (corrupting
or removing a chunk) go straight to the directory or the S3 API, never through the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import random
import tarfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.errors import (
    InvalidArgument,
    SnapshotCorrupt,
    SnapshotNotFound,
    StorageUnavailable,
)
from snapshotter.storage import (
    LocalDirStore,
    ObjectMissing,
    ObjectStore,
    Progress,
    S3Store,
    S3Tuning,
    SnapshotReader,
    SnapshotWriter,
    delete_snapshot,
    find_orphans,
    list_snapshots,
    open_store,
)
from snapshotter.storage import format as fmt
from tests.functional.conftest import Backend
from tests.support.seaweed import SeaweedServer, seaweed_server  # noqa: F401 - fixture

pytestmark = pytest.mark.timeout(180)

KiB = 1024
MiB = 1024 * KiB


# -- test data ----------------------------------------------------------------------------


def _mixed_bytes(size: int, seed: int) -> bytes:
    """Alternating 100 KiB runs of random (incompressible) and repetitive bytes."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < size:
        run = min(100 * KiB, size - len(out))
        random_run = (len(out) // (100 * KiB)) % 2 == 0
        out += rng.randbytes(run) if random_run else (b"ckpt" * (run // 4 + 1))[:run]
    return bytes(out[:size])


def _make_tree(root: Path) -> dict[str, bytes]:
    files = {
        "core-1.img": _mixed_bytes(300 * KiB + 13, 1),
        "pages-1.img": _mixed_bytes(2 * MiB + 5, 2),
        "inventory.img": b"",
        "sub/dir/mm-7.img": b"\x00\x01" * 4096,
        "sub/other.img": os.urandom(70 * KiB),
    }
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "empty-dir").mkdir()
    return files


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _sid() -> str:
    return f"snap-{uuid.uuid4().hex[:10]}"


def _write_snapshot(store: ObjectStore, sid: str, stream: bytes, tree: Path | None) -> None:
    with SnapshotWriter(store, sid, chunk_size=64 * KiB, workers=3) as w:
        w.write_stream("rank-0-raw", io.BytesIO(stream))
        if tree is not None:
            w.add_directory("rank-0", tree)
        w.commit({"job": "j1"})


# -- object store operations --------------------------------------------------------------


def test_put_get_head_list_delete(store: ObjectStore) -> None:
    assert store.head("a/b/c") is None
    with pytest.raises(ObjectMissing):
        store.get_bytes("a/b/c")
    store.put_bytes("a/b/c", b"hello")
    store.put_bytes("a/b/d", b"")
    store.put_bytes("a/x/1", b"1" * 1000)
    store.put_bytes("top", b"t")
    assert store.get_bytes("a/b/c") == b"hello"
    assert store.get_bytes("a/b/d") == b""
    assert store.head("a/b/c") == 5 and store.head("a/b/d") == 0
    assert store.head("a/b") is None  # a "directory" is not an object
    store.put_bytes("a/b/c", b"replaced")
    assert store.get_bytes("a/b/c") == b"replaced"
    assert sorted(store.list_keys()) == ["a/b/c", "a/b/d", "a/x/1", "top"]
    assert sorted(store.list_keys("a/")) == ["a/b/c", "a/b/d", "a/x/1"]
    assert sorted(store.list_keys("a/b")) == ["a/b/c", "a/b/d"]
    assert sorted(store.list_keys("a/b/c")) == ["a/b/c"]
    assert list(store.list_keys("nothing/")) == []
    assert sorted(store.list_dirs("a/")) == ["b", "x"]
    assert sorted(store.list_dirs("")) == ["a"]
    assert store.delete_keys(["a/b/c", "a/x/1", "never/was"]) == []
    assert sorted(store.list_keys()) == ["a/b/d", "top"]
    # Emptied "directories" may linger in listings (SeaweedFS keeps empty folders a while).
    assert "b" in set(store.list_dirs("a/")) <= {"b", "x"}
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"x")


def test_concurrent_puts(store: ObjectStore) -> None:
    def put(i: int) -> None:
        store.put_bytes(f"c/{i % 5}/{i}", bytes([i % 256]) * (1000 + i))

    threads = [threading.Thread(target=put, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(list(store.list_keys("c/"))) == 40
    assert store.head("c/3/13") == 1013


def test_list_objects_gives_size_and_write_time(store: ObjectStore) -> None:
    assert list(store.list_objects("o/")) == []
    t0 = time.time()
    store.put_bytes("o/a/1", b"x" * 1000)
    store.put_bytes("o/a/2", b"")
    store.put_bytes("o/b", b"yy")
    store.put_bytes("other", b"z")
    t1 = time.time()
    objs = {o.key: o for o in store.list_objects("o/")}
    assert sorted(objs) == sorted(store.list_keys("o/")) == ["o/a/1", "o/a/2", "o/b"]
    assert {k: o.size for k, o in objs.items()} == {"o/a/1": 1000, "o/a/2": 0, "o/b": 2}
    # Same clock here; S3 servers may round LastModified to whole seconds.
    assert all(t0 - 2 <= o.mtime <= t1 + 2 for o in objs.values())
    assert sorted(o.key for o in store.list_objects("o/a")) == ["o/a/1", "o/a/2"]
    assert {o.key for o in store.list_objects()} == {"o/a/1", "o/a/2", "o/b", "other"}
    store.put_bytes("o/b", b"longer")
    assert [(o.key, o.size) for o in store.list_objects("o/b")] == [("o/b", 6)]
    store.delete_keys(["o/a/1"])
    assert sorted(o.key for o in store.list_objects("o/")) == ["o/a/2", "o/b"]


# -- snapshots: write, commit, read back --------------------------------------------------


def test_round_trip_stream_and_directory(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "images"
    files = _make_tree(src)
    stream = _mixed_bytes(3 * MiB + 12345, 7)
    sid = _sid()
    seen: list[Progress] = []
    with SnapshotWriter(store, sid, chunk_size=64 * KiB, workers=4, progress=seen.append) as w:
        info = w.write_stream("rank-0-raw", io.BytesIO(stream))
        assert info.raw_size == len(stream)
        assert len(info.chunks) == fmt.chunk_count(len(stream), 64 * KiB) == 49
        assert info.stored_size < info.raw_size  # the repetitive half compresses
        w.write_stream("empty", io.BytesIO(b""))
        tree_info = w.add_directory("rank-0", src)
        manifest = w.commit({"job": {"id": "j1", "world_size": 1}})

    assert list_snapshots(store) == [sid]
    assert find_orphans(store) == []
    assert manifest.streams["rank-0"] == tree_info
    assert seen[-1].total_raw_bytes == info.raw_size + tree_info.raw_size
    assert seen[-1].total_stored_bytes == manifest.stored_size

    reader = SnapshotReader(store, sid)
    m = reader.manifest()
    assert m == manifest
    assert m.meta == {"job": {"id": "j1", "world_size": 1}}
    staged = reader.verify_and_fetch(tmp_path / "staging")
    assert sorted(staged) == ["empty", "rank-0", "rank-0-raw"]
    assert staged["rank-0-raw"].read_bytes() == stream
    assert staged["empty"].read_bytes() == b""
    out = reader.extract_directory("rank-0", tmp_path / "restored")
    assert _tree(out) == files
    assert (out / "empty-dir").is_dir()
    assert not staged["rank-0"].exists()  # staging copy removed after extraction


def test_fetch_selected_streams_only(store: ObjectStore, tmp_path: Path) -> None:
    sid = _sid()
    with SnapshotWriter(store, sid, chunk_size=64 * KiB) as w:
        w.write_stream("a", io.BytesIO(b"A" * 200_000))
        w.write_stream("b", io.BytesIO(b"B" * 200_000))
        w.commit({})
    reader = SnapshotReader(store, sid)
    staged = reader.verify_and_fetch(tmp_path / "st", streams=["b"])
    assert list(staged) == ["b"] and staged["b"].read_bytes() == b"B" * 200_000
    assert not (tmp_path / "st" / "a.stream").exists()
    with pytest.raises(InvalidArgument, match="no stream"):
        reader.verify_and_fetch(tmp_path / "st", streams=["c"])


def test_streams_written_in_parallel(store: ObjectStore, tmp_path: Path) -> None:
    sid = _sid()
    data = {f"rank-{i}": _mixed_bytes(500 * KiB + i, i) for i in range(4)}
    with SnapshotWriter(store, sid, chunk_size=64 * KiB, workers=3) as w:
        threads = [
            threading.Thread(target=w.write_stream, args=(n, io.BytesIO(d)))
            for n, d in data.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        w.commit({})
    staged = SnapshotReader(store, sid).verify_and_fetch(tmp_path / "st")
    assert {n: p.read_bytes() for n, p in staged.items()} == data


# -- commit is all or nothing -------------------------------------------------------------


@pytest.mark.usefixtures("format_1")
def test_uncommitted_snapshot_is_invisible_and_abort_removes_it(
    backend: Backend, tmp_path: Path
) -> None:
    store = backend.store
    sid = _sid()
    w = SnapshotWriter(store, sid, chunk_size=64 * KiB)
    w.write_stream("rank-0", io.BytesIO(os.urandom(300 * KiB)))
    assert len(list(store.list_keys(fmt.snapshot_prefix(sid)))) == 5
    assert sid not in list_snapshots(store)
    assert find_orphans(store) == [sid]
    with pytest.raises(SnapshotNotFound) as e:
        SnapshotReader(store, sid).manifest()
    assert store.describe() in str(e.value)
    assert w.abort() == []
    assert list(store.list_keys(fmt.snapshot_prefix(sid))) == []
    assert find_orphans(store) == []
    with pytest.raises(RuntimeError):
        w.write_stream("rank-1", io.BytesIO(b"x"))


def test_failure_inside_writer_block_aborts(store: ObjectStore) -> None:
    sid = _sid()
    with pytest.raises(ZeroDivisionError):
        with SnapshotWriter(store, sid, chunk_size=64 * KiB) as w:
            w.write_stream("rank-0", io.BytesIO(os.urandom(200 * KiB)))
            1 / 0  # noqa: B018 - the freeze fails after some uploads
    assert list(store.list_keys(fmt.snapshot_prefix(sid))) == []
    assert list_snapshots(store) == []


def test_failing_source_poisons_the_snapshot(store: ObjectStore) -> None:
    class Broken(io.RawIOBase):
        def __init__(self) -> None:
            self.calls = 0

        def readable(self) -> bool:
            return True

        def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
            self.calls += 1
            if self.calls > 3:
                raise OSError("disk read error")
            n = min(len(b), 10)
            b[:n] = b"0123456789"[:n]
            return n

    sid = _sid()
    w = SnapshotWriter(store, sid, chunk_size=16)
    with pytest.raises(OSError, match="disk read error"):
        w.write_stream("rank-0", Broken())
    with pytest.raises(OSError, match="disk read error"):
        w.commit({})
    w.abort()
    assert list_snapshots(store) == [] and find_orphans(store) == []


def test_refuses_existing_snapshot_and_duplicate_stream(store: ObjectStore) -> None:
    sid = _sid()
    with SnapshotWriter(store, sid) as w:
        w.write_stream("s", io.BytesIO(b"x"))
        with pytest.raises(InvalidArgument, match="twice"):
            w.write_stream("s", io.BytesIO(b"y"))
        w.commit({})
    with pytest.raises(InvalidArgument, match="already exists"):
        SnapshotWriter(store, sid)
    with pytest.raises(InvalidArgument, match="snapshot id"):
        SnapshotWriter(store, "../etc")
    with pytest.raises(InvalidArgument, match="JSON"):
        with SnapshotWriter(store, _sid()) as w:
            w.commit({"bad": object()})


# -- a thaw verifies everything before restoring anything ---------------------------------


def _committed(store: ObjectStore, tmp_path: Path) -> tuple[str, fmt.Manifest]:
    src = tmp_path / "images"
    _make_tree(src)
    sid = _sid()
    _write_snapshot(store, sid, _mixed_bytes(1 * MiB, 3), src)
    return sid, SnapshotReader(store, sid).manifest()


@pytest.mark.parametrize("damage", ["flip-byte", "truncate", "garbage"])
def test_corrupt_chunk_is_named_and_nothing_is_restored(
    backend: Backend, tmp_path: Path, damage: str
) -> None:
    store = backend.store
    sid, m = _committed(store, tmp_path)
    victim = m.streams["rank-0"].chunks[2]
    good = store.get_bytes(victim.key)
    bad = {
        "flip-byte": good[:10] + bytes([good[10] ^ 0xFF]) + good[11:],
        "truncate": good[:-1],
        "garbage": os.urandom(len(good)),
    }[damage]
    backend.raw_put(victim.key, bad)

    reader = SnapshotReader(store, sid)
    staging = tmp_path / "staging"
    with pytest.raises(SnapshotCorrupt) as e:
        reader.verify_and_fetch(staging)
    msg = str(e.value)
    assert sid in msg and "'rank-0'" in msg and "chunk 2" in msg and victim.key in msg
    assert e.value.next_step
    assert list(staging.iterdir()) == []  # no staged bytes survive a failed verification
    with pytest.raises(InvalidArgument, match="not been verified"):
        reader.extract_directory("rank-0", tmp_path / "restored")
    assert not (tmp_path / "restored").exists()
    # The untouched stream alone still verifies.
    assert reader.verify_and_fetch(staging, streams=["rank-0-raw"])


def test_missing_chunk_is_corrupt(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    sid, m = _committed(store, tmp_path)
    victim = m.streams["rank-0-raw"].chunks[-1]
    backend.raw_delete(victim.key)
    with pytest.raises(SnapshotCorrupt, match="missing") as e:
        SnapshotReader(store, sid).verify_and_fetch(tmp_path / "staging")
    assert victim.key in str(e.value) and f"chunk {victim.index}" in str(e.value)


def test_damaged_manifest_is_corrupt(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    sid, _ = _committed(store, tmp_path)
    key = fmt.manifest_key(sid)
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    backend.raw_put(key, bytes(data))
    with pytest.raises(SnapshotCorrupt, match="manifest"):
        SnapshotReader(store, sid).manifest()


def test_unsafe_archive_member_is_refused(store: ObjectStore, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("ok.img", "../escape.img"):
            ti = tarfile.TarInfo(name)
            ti.size = 3
            tar.addfile(ti, io.BytesIO(b"bad"))
    sid = _sid()
    with SnapshotWriter(store, sid) as w:
        w.write_stream("rank-0", io.BytesIO(buf.getvalue()))
        w.commit({})
    reader = SnapshotReader(store, sid)
    reader.verify_and_fetch(tmp_path / "st")
    with pytest.raises(SnapshotCorrupt, match="unsafe"):
        reader.extract_directory("rank-0", tmp_path / "out" / "rank-0")
    assert not (tmp_path / "out" / "rank-0").exists()
    assert not (tmp_path / "out" / "escape.img").exists()
    assert list((tmp_path / "out").iterdir()) == []


# -- catalogue ----------------------------------------------------------------------------


@pytest.mark.usefixtures("format_1")
def test_list_and_delete_snapshots(store: ObjectStore, tmp_path: Path) -> None:
    ids = sorted(_sid() for _ in range(3))
    for sid in ids:
        _write_snapshot(store, sid, os.urandom(150 * KiB), None)
    orphan = _sid()
    w = SnapshotWriter(store, orphan, chunk_size=64 * KiB)
    w.write_stream("x", io.BytesIO(b"x" * 100))
    assert list_snapshots(store) == ids
    assert find_orphans(store) == [orphan]

    assert delete_snapshot(store, ids[1]) == []
    assert list_snapshots(store) == [ids[0], ids[2]]
    assert list(store.list_keys(fmt.snapshot_prefix(ids[1]))) == []
    with pytest.raises(SnapshotNotFound):
        delete_snapshot(store, ids[1])
    with pytest.raises(SnapshotNotFound):
        SnapshotReader(store, ids[1]).manifest()
    assert delete_snapshot(store, orphan) == []  # gc path: orphans delete the same way
    assert find_orphans(store) == []
    assert SnapshotReader(store, ids[0]).verify_and_fetch(tmp_path / "st")
    assert w.abort() == []


# -- bounded memory -----------------------------------------------------------------------


class GeneratedFile(io.RawIOBase):
    """`size` bytes made on demand (alternating random and constant blocks), never held."""

    def __init__(self, size: int, block: bytes) -> None:
        self.remaining = size
        self.block = block
        self.zeros = bytes(len(block))
        self.sha = hashlib.sha256()
        self.n = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        n = min(len(b), self.remaining, len(self.block))
        if n <= 0:
            return 0
        self.n += 1
        piece = memoryview(self.block if self.n % 2 else self.zeros)[:n]
        b[:n] = piece
        self.sha.update(piece)
        self.remaining -= n
        return n


def test_memory_stays_bounded_whatever_the_image_size(store: ObjectStore) -> None:
    size = 200 * MiB
    chunk = 1 * MiB
    workers = 2
    src = GeneratedFile(size, os.urandom(chunk))
    sid = _sid()
    w = SnapshotWriter(store, sid, chunk_size=chunk, workers=workers)
    tracemalloc.start()
    try:
        info = w.write_stream("rank-0", src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    w.commit({})
    assert info.raw_size == size and len(info.chunks) >= size // chunk
    # In flight: 2*workers raw chunks, plus per running worker its compressed copy and the
    # S3 client's checksum read buffer, plus the chunk being read: 4*workers + 1. The stream
    # is 200 chunks; holding even a twentieth of it would blow through this.
    bound = (4 * workers + 3) * chunk  # one chunk of slack for interpreter noise
    assert peak < bound, f"peak traced memory {peak / MiB:.1f} MiB >= {bound / MiB:.0f} MiB"
    assert delete_snapshot(store, sid) == []


# -- thaw staging: verified compressed chunks, decompressed while untarring ---------------


def _two_ranks(store: ObjectStore, tmp_path: Path) -> tuple[str, dict[str, dict[str, bytes]]]:
    trees = {}
    sid = _sid()
    with SnapshotWriter(store, sid, chunk_size=64 * KiB, workers=3) as w:
        for r in ("rank-0", "rank-1"):
            trees[r] = _make_tree(tmp_path / "images" / r)
            w.add_directory(r, tmp_path / "images" / r)
        w.commit({})
    return sid, trees


@pytest.mark.usefixtures("format_1")
def test_compressed_staging_round_trip_in_parallel(store: ObjectStore, tmp_path: Path) -> None:
    sid, trees = _two_ranks(store, tmp_path)
    reader = SnapshotReader(store, sid)
    m = reader.manifest()
    staging = tmp_path / "staging"
    staged = reader.verify_and_fetch(staging, streams=list(trees), decompress=False)
    # Only the stored bytes are staged: no raw copy of the stream is ever written.
    assert sorted(p.name for p in staging.iterdir()) == ["rank-0.zst", "rank-1.zst"]
    for r, p in staged.items():
        assert p.stat().st_size == m.streams[r].stored_size < m.streams[r].raw_size

    # Both streams are extracted at once: each waits here, on its first member, for the other.
    barrier = threading.Barrier(2, timeout=30)
    started: set[str] = set()
    check = reader._check_member

    def check_together(stream: str, member: tarfile.TarInfo) -> None:
        if stream not in started:
            started.add(stream)
            barrier.wait()
        check(stream, member)

    reader._check_member = check_together  # type: ignore[method-assign]
    out = reader.extract_directories({r: tmp_path / "out" / r for r in trees})
    assert out == {r: tmp_path / "out" / r for r in trees}
    for r, files in trees.items():
        assert _tree(out[r]) == files and (out[r] / "empty-dir").is_dir()
    assert list(staging.iterdir()) == []  # staged chunks removed after extraction
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank-0", "rank-1"]


@pytest.mark.usefixtures("format_1")
def test_compressed_staging_corrupt_chunk_fails_the_fetch(backend: Backend, tmp_path: Path) -> None:
    store = backend.store
    sid, trees = _two_ranks(store, tmp_path)
    victim = SnapshotReader(store, sid).manifest().streams["rank-1"].chunks[3]
    good = store.get_bytes(victim.key)
    backend.raw_put(victim.key, good[:20] + bytes([good[20] ^ 0x01]) + good[21:])

    reader = SnapshotReader(store, sid)
    staging = tmp_path / "staging"
    with pytest.raises(SnapshotCorrupt) as e:
        reader.verify_and_fetch(staging, streams=list(trees), decompress=False)
    msg = str(e.value)
    assert sid in msg and "'rank-1'" in msg and "chunk 3" in msg and victim.key in msg
    assert "sha256" in msg
    assert list(staging.iterdir()) == []
    with pytest.raises(InvalidArgument, match="not been verified"):
        reader.extract_directories({r: tmp_path / "out" / r for r in trees})
    assert not (tmp_path / "out").exists()


def _with_wrong_raw_hash(backend: Backend, sid: str, stream: str, index: int) -> fmt.ChunkInfo:
    """Rewrite the manifest (with a valid checksum) so one chunk's stored bytes still match
    but its raw sha256 does not: only decompression can find the mismatch."""
    store = backend.store
    m = SnapshotReader(store, sid).manifest()
    s = m.streams[stream]
    chunks = list(s.chunks)
    victim = dataclasses.replace(chunks[index], raw_sha256="0" * 64)
    chunks[index] = victim
    streams = dict(m.streams)
    streams[stream] = dataclasses.replace(s, chunks=tuple(chunks))
    backend.raw_put(fmt.manifest_key(sid), dataclasses.replace(m, streams=streams).to_json())
    return victim


@pytest.mark.usefixtures("format_1")
@pytest.mark.parametrize("where", ["first", "last"])
def test_raw_hash_mismatch_found_while_extracting_leaves_nothing(
    backend: Backend, tmp_path: Path, where: str
) -> None:
    store = backend.store
    sid, trees = _two_ranks(store, tmp_path)
    n = len(SnapshotReader(store, sid).manifest().streams["rank-0"].chunks)
    # The last chunk ends with the archive's end padding, which tar itself need not read.
    victim = _with_wrong_raw_hash(backend, sid, "rank-0", 0 if where == "first" else n - 1)

    reader = SnapshotReader(store, sid)
    reader.verify_and_fetch(tmp_path / "staging", streams=list(trees), decompress=False)
    out = tmp_path / "out"
    with pytest.raises(SnapshotCorrupt) as e:
        reader.extract_directories({r: out / r for r in trees})
    msg = str(e.value)
    assert sid in msg and "'rank-0'" in msg and f"chunk {victim.index}" in msg
    assert victim.key in msg and "wrong bytes" in msg
    assert list(out.iterdir()) == []  # neither stream, nor a temp directory, is left


@pytest.mark.usefixtures("format_1")
def test_damaged_staged_copy_is_caught_while_extracting(store: ObjectStore, tmp_path: Path) -> None:
    sid, trees = _two_ranks(store, tmp_path)
    reader = SnapshotReader(store, sid)
    staged = reader.verify_and_fetch(tmp_path / "staging", streams=["rank-0"], decompress=False)
    with open(staged["rank-0"], "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 1)
    with pytest.raises(SnapshotCorrupt, match="chunk") as e:
        reader.extract_directory("rank-0", tmp_path / "out" / "rank-0")
    assert "'rank-0'" in str(e.value)
    assert list((tmp_path / "out").iterdir()) == []


def test_extraction_memory_stays_bounded(store: ObjectStore, tmp_path: Path) -> None:
    chunk = 1 * MiB
    images = tmp_path / "images"
    images.mkdir()
    block = os.urandom(chunk)
    with open(images / "pages-1.img", "wb") as f:
        for i in range(200):
            f.write(block if i % 2 else bytes(chunk))
    sid = _sid()
    with SnapshotWriter(store, sid, chunk_size=chunk, workers=2) as w:
        w.add_directory("rank-0", images)
        w.commit({})
    reader = SnapshotReader(store, sid, workers=2)
    reader.manifest()
    tracemalloc.start()
    try:
        reader.verify_and_fetch(tmp_path / "staging", decompress=False)
        _, fetch_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        reader.extract_directory("rank-0", tmp_path / "out")
        _, extract_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (tmp_path / "out" / "pages-1.img").stat().st_size == 200 * chunk
    # Fetch: 2*workers stored chunks in flight, plus a copy per running worker in the
    # backend's client. Extraction: the chunk being read, the one checked ahead, the one
    # being decompressed, and one stored chunk. The stream is 200 chunks.
    assert fetch_peak < (4 * 2 + 2) * chunk, f"fetch peak {fetch_peak / MiB:.1f} MiB"
    assert extract_peak < 6 * chunk, f"extract peak {extract_peak / MiB:.1f} MiB"


# -- storage unavailable ------------------------------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_s3_unreachable_endpoint() -> None:
    port = _closed_port()
    store = S3Store(
        "snapshots",
        "p",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        access_key_id="k",
        secret_access_key="s",
        tuning=S3Tuning(max_attempts=2, connect_timeout_s=1, read_timeout_s=2),
    )
    with pytest.raises(StorageUnavailable) as e:
        store.put_bytes("a", b"x")
    assert f"127.0.0.1:{port}" in str(e.value) and "snapshots" in str(e.value)
    assert "reachable" in e.value.next_step
    with pytest.raises(StorageUnavailable):
        SnapshotWriter(store, "s1")
    with pytest.raises(StorageUnavailable):
        list_snapshots(store)
    with pytest.raises(StorageUnavailable):
        SnapshotReader(store, "s1").manifest()


@pytest.mark.s3
def test_s3_missing_bucket_and_bad_credentials(seaweed_server: SeaweedServer) -> None:  # noqa: F811
    kw = seaweed_server.store_kwargs()
    store = S3Store("no-such-bucket-here", **kw)
    with pytest.raises(StorageUnavailable) as e:
        store.head("x")
    assert "no-such-bucket-here" in str(e.value) and seaweed_server.endpoint_url in str(e.value)
    assert "create" in e.value.next_step

    kw["secret_access_key"] = "wrong"
    store = S3Store(seaweed_server.bucket, **kw)
    with pytest.raises(StorageUnavailable) as e:
        store.put_bytes("x", b"x")
    assert "credentials" in e.value.next_step
    assert "wrong" not in str(e.value)


def test_local_root_unusable(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store should be")
    store = LocalDirStore(blocker / "store")
    with pytest.raises(StorageUnavailable) as e:
        store.put_bytes("a/b", b"x")
    assert str(blocker) in str(e.value) and "writable" in e.value.next_step
    with pytest.raises(StorageUnavailable):
        with SnapshotWriter(store, "s1") as w:
            w.write_stream("r", io.BytesIO(b"data"))
    with pytest.raises(StorageUnavailable):
        list_snapshots(LocalDirStore(blocker))


# -- S3 specifics -------------------------------------------------------------------------


@pytest.mark.usefixtures("format_1")
@pytest.mark.s3
def test_s3_keys_land_under_prefix(seaweed_server: SeaweedServer) -> None:  # noqa: F811
    prefix = f"team-a/{uuid.uuid4().hex[:8]}"
    store = S3Store(seaweed_server.bucket, prefix + "/", **seaweed_server.store_kwargs())
    sid = _sid()
    _write_snapshot(store, sid, os.urandom(200 * KiB), None)
    keys = seaweed_server.keys("team-a/")
    assert keys and all(k.startswith(prefix + "/snapshots/" + sid + "/") for k in keys)
    assert f"{prefix}/snapshots/{sid}/manifest.json" in keys
    assert list_snapshots(store) == [sid]
    # A store on the bucket root sees the same objects one level down, not as snapshots.
    root = S3Store(seaweed_server.bucket, **seaweed_server.store_kwargs())
    assert sid not in list_snapshots(root)


@pytest.mark.s3
def test_s3_configured_the_aws_way(
    seaweed_server: SeaweedServer,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    store = open_store(f"s3://{seaweed_server.bucket}/env-{uuid.uuid4().hex[:8]}")
    assert isinstance(store, S3Store) and store.endpoint_url == seaweed_server.endpoint_url
    sid = _sid()
    _write_snapshot(store, sid, b"hello" * 1000, None)
    assert list_snapshots(store) == [sid]


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = {t.ident for t in threading.enumerate()}
    yield
    extra = [
        t
        for t in threading.enumerate()
        if t.ident not in before
        and t.name.startswith(("snap-", "fetch-", "tar-", "extract-"))
        and t.is_alive()
    ]
    for t in extra:
        t.join(5)
    assert not [t.name for t in extra if t.is_alive()], "storage threads left running"


def test_uncommitted_chunks_read_back_from_their_list_and_only_from_it(tmp_path: Path) -> None:
    """A migration through the store (`migrate --via-store`) commits no manifest: the target
    reads the streams from the chunk list the source reported, every chunk checked as a
    committed snapshot's; a list naming a key outside the snapshot, or a chunk that changed,
    is refused before anything is extracted."""
    from snapshotter.errors import SnapshotCorrupt
    from snapshotter.storage import LocalDirStore, SnapshotReader, SnapshotWriter

    store = LocalDirStore(tmp_path / "store")
    src = tmp_path / "rank-3"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(3 << 20))
    (src / "core.img").write_bytes(b"core" * 100)
    w = SnapshotWriter(store, "job-m-0001", chunk_size=1 << 20)
    info = w.add_directory("rank-3", src).to_dict()
    w.release()
    assert store.head("snapshots/job-m-0001/manifest.json") is None  # invisible to list/thaw

    reader = SnapshotReader(store, "job-m-0001", uncommitted={"rank-3": info})
    reader.verify_and_fetch(tmp_path / "staging", streams=["rank-3"], decompress=False)
    reader.extract_directories({"rank-3": tmp_path / "out"})
    assert (tmp_path / "out" / "pages-1.img").read_bytes() == (src / "pages-1.img").read_bytes()

    outside = {**info, "chunks": [{**info["chunks"][0], "key": "snapshots/other/chunks/x/0"},
                                  *info["chunks"][1:]]}  # fmt: skip
    with pytest.raises(SnapshotCorrupt, match="outside the snapshot"):
        SnapshotReader(store, "job-m-0001", uncommitted={"rank-3": outside})
    key = info["chunks"][1]["key"]
    store.put_bytes(key, b"tampered")
    with pytest.raises(SnapshotCorrupt):
        SnapshotReader(store, "job-m-0001", uncommitted={"rank-3": info}).verify_and_fetch(
            tmp_path / "staging2", streams=["rank-3"], decompress=False
        )
