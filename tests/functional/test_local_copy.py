"""A node's local copy of a committed snapshot (snapshotter/agent/local_copy.py, storage/
dirstream.py), against real files, real tar streams and a real local-directory store: it is
used only when it is byte for byte the committed stream, and refused (and deleted) otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapshotter.agent.local_copy import LINK_MIN_BYTES, Copy, LocalCopies, to_evict
from snapshotter.config import local_copy_bytes
from snapshotter.errors import InvalidArgument
from snapshotter.storage import LocalDirStore, SnapshotReader, SnapshotWriter, dirstream

pytestmark = pytest.mark.timeout(120)


def images(root: Path, seed: int = 1) -> Path:
    """A directory shaped like CRIU's: a large page image, small metadata, a subdirectory."""
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(3 * LINK_MIN_BYTES + 17))
    (root / "files.img").write_bytes(bytes([seed]) * 900)
    (root / "kept").mkdir()
    (root / "kept" / "metrics.csv").write_text("step,loss\n1,0.5\n")
    return root


@pytest.fixture
def committed(tmp_path: Path) -> tuple[LocalDirStore, str, Path]:
    """A snapshot of two ranks' image directories, committed with a small chunk size so a
    stream spans many chunks; returns the store, its id and the work directory."""
    store = LocalDirStore(tmp_path / "store")
    work = tmp_path / "home" / "work" / "freeze-1"
    for r in (0, 1):
        images(work / f"rank-{r}", seed=r)
    with SnapshotWriter(store, "job-a-0001", chunk_size=1 << 20) as w:
        for r in (0, 1):
            w.add_directory(f"rank-{r}", work / f"rank-{r}")
        w.commit({"job": "a"})
    return store, "job-a-0001", work


def test_a_kept_copy_matches_its_manifest_and_fills_a_thaw(
    tmp_path: Path, committed: tuple[LocalDirStore, str, Path]
) -> None:
    store, sid, work = committed
    want = {p.relative_to(work): p.read_bytes() for p in work.rglob("*") if p.is_file()}
    copies = LocalCopies(tmp_path / "home" / "copies", cap_bytes=1 << 30)
    assert copies.keep("job-a", sid, work, ["rank-0", "rank-1"])
    assert not (work / "rank-0").exists()  # moved, not copied
    manifest = SnapshotReader(store, sid).manifest()
    assert len(manifest.streams["rank-0"].chunks) > 3
    dest = tmp_path / "home" / "work" / "thaw-1"
    assert copies.take(manifest, ["rank-0", "rank-1"], dest, workers=2)
    got = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert got == want
    # The page image is linked (no copy of the big file), the small ones are copies a restore
    # may rewrite without touching the kept copy.
    kept = copies.root / "job-a" / sid / "rank-0"
    assert os.stat(dest / "rank-0" / "pages-1.img").st_ino == os.stat(kept / "pages-1.img").st_ino
    assert os.stat(dest / "rank-0" / "files.img").st_ino != os.stat(kept / "files.img").st_ino
    (dest / "rank-0" / "files.img").write_bytes(b"rewritten by a restore")
    assert dirstream.matches(manifest.streams["rank-0"], kept) == ""


@pytest.mark.parametrize("damage", ["byte", "extra file", "missing file", "mtime", "truncated"])
def test_a_copy_that_differs_in_any_way_is_refused_and_deleted(
    tmp_path: Path, committed: tuple[LocalDirStore, str, Path], damage: str
) -> None:
    store, sid, work = committed
    copies = LocalCopies(tmp_path / "home" / "copies", cap_bytes=1 << 30)
    assert copies.keep("job-a", sid, work, ["rank-0", "rank-1"])
    kept = copies.root / "job-a" / sid / "rank-1"
    page = kept / "pages-1.img"
    if damage == "byte":
        before = os.stat(page)
        with open(page, "r+b") as f:
            f.seek(LINK_MIN_BYTES + 5)
            b = f.read(1)
            f.seek(LINK_MIN_BYTES + 5)
            f.write(bytes([b[0] ^ 1]))
        # Its times put back: only the content says it changed.
        os.utime(page, ns=(before.st_atime_ns, before.st_mtime_ns))
    elif damage == "extra file":
        (kept / "zz.img").write_bytes(b"x")
    elif damage == "missing file":
        (kept / "files.img").unlink()
    elif damage == "mtime":
        os.utime(page, (1_000_000, 1_000_000))
    else:
        os.truncate(page, 1000)
    manifest = SnapshotReader(store, sid).manifest()
    assert dirstream.matches(manifest.streams["rank-1"], kept) != ""
    assert dirstream.matches(manifest.streams["rank-0"], kept.parent / "rank-0") == ""
    dest = tmp_path / "thaw"
    dest.mkdir()
    assert not copies.take(manifest, ["rank-0", "rank-1"], dest, workers=2)
    assert list(dest.iterdir()) == []  # nothing half-filled for the fetch that follows
    assert not (copies.root / "job-a" / sid).exists()


def test_no_copy_for_another_snapshot_or_stream_or_when_off(
    tmp_path: Path, committed: tuple[LocalDirStore, str, Path]
) -> None:
    store, sid, work = committed
    manifest = SnapshotReader(store, sid).manifest()
    off = LocalCopies(tmp_path / "off", cap_bytes=0)
    assert not off.keep("job-a", sid, work, ["rank-0"])
    assert (work / "rank-0").is_dir()  # left where it was, for the freeze's own clean-up
    copies = LocalCopies(tmp_path / "home" / "copies", cap_bytes=1 << 30)
    dest = tmp_path / "thaw"
    assert not copies.take(manifest, ["rank-0"], dest, workers=1)  # nothing kept yet
    assert copies.keep("job-a", sid, work, ["rank-0"])
    assert not copies.take(manifest, ["rank-0", "rank-9"], dest, workers=1)
    # Ranks this node did not dump (placed elsewhere after a recovery): fetched, and the
    # copy is kept for a later thaw that places them as before.
    assert not copies.take(manifest, ["rank-1"], dest, workers=1)
    assert (copies.root / "job-a" / sid / "rank-0").is_dir()
    assert not copies.keep("job-a", "../escape", work, ["rank-1"])


def test_keeping_a_newer_snapshot_replaces_the_jobs_older_copy(
    tmp_path: Path, committed: tuple[LocalDirStore, str, Path]
) -> None:
    _, sid, work = committed
    copies = LocalCopies(tmp_path / "home" / "copies", cap_bytes=1 << 30)
    assert copies.keep("job-a", sid, work, ["rank-0"])
    newer = tmp_path / "home" / "work" / "freeze-2"
    images(newer / "rank-0")
    assert copies.keep("job-a", "job-a-0002", newer, ["rank-0"])
    assert [c.snapshot_id for c in copies.listed()] == ["job-a-0002"]


def test_eviction_keeps_each_jobs_newest_copy_and_fits_the_cap() -> None:
    a1, a2 = Copy("a", "a-1", 40, 1.0), Copy("a", "a-2", 40, 5.0)
    b1, c1 = Copy("b", "b-1", 30, 3.0), Copy("c", "c-1", 50, 4.0)
    assert to_evict([a1, a2, b1, c1], cap_bytes=1000) == [a1]
    # Over the cap: the oldest job's copy goes first, then the next, until it fits.
    assert to_evict([a1, a2, b1, c1], cap_bytes=90) == [a1, b1]
    assert to_evict([a1, a2, b1, c1], cap_bytes=39) == [a1, b1, c1, a2]
    assert to_evict([], cap_bytes=0) == []


def test_the_cap_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SNAPSHOTTER_LOCAL_COPY_BYTES", raising=False)
    st = os.statvfs(tmp_path)
    assert local_copy_bytes(tmp_path) == st.f_blocks * st.f_frsize // 4
    monkeypatch.setenv("SNAPSHOTTER_LOCAL_COPY_BYTES", "0")
    assert local_copy_bytes(tmp_path) == 0
    monkeypatch.setenv("SNAPSHOTTER_LOCAL_COPY_BYTES", "5000000000")
    assert local_copy_bytes(tmp_path) == 5_000_000_000
    for bad in ("-1", "1GB", "lots"):
        monkeypatch.setenv("SNAPSHOTTER_LOCAL_COPY_BYTES", bad)
        with pytest.raises(InvalidArgument) as e:
            local_copy_bytes(tmp_path)
        assert "SNAPSHOTTER_LOCAL_COPY_BYTES" in e.value.cause and "0 keeps" in e.value.next_step
