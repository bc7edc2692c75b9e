"""Progress a CLI can show as a percentage and a time left, for a freeze's upload and a thaw's
fetch: each node says how many raw bytes it moves in all (`total_bytes`) and how many it has
moved (`raw_bytes`, never more). Real files, real tar streams, a real local-directory store
(and S3 where the reader is concerned), the agent's own upload and fetch code."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from snapshotter.agent import handoff
from snapshotter.agent.freeze import Freeze, FreezePhase, Freezes
from snapshotter.agent.local_copy import LocalCopies
from snapshotter.agent.rdzv import RdzvHost
from snapshotter.agent.runtime import JobTable
from snapshotter.agent.sandboxes import Sandboxes
from snapshotter.agent.thaw import Thaws
from snapshotter.config import Paths
from snapshotter.errors import SnapshotCorrupt
from snapshotter.storage import (
    LocalDirStore,
    ObjectStore,
    SnapshotReader,
    SnapshotWriter,
    dirstream,
)
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2

pytestmark = pytest.mark.timeout(120)

KiB = 1024
STREAMS = ["rank-0", "rank-1"]


def images(root: Path, seed: int) -> Path:
    """Shaped like CRIU's: a page image of half random, half repeated bytes, small metadata,
    an empty file, a subdirectory."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(rng.randbytes(600 * KiB) + b"page" * (150 * KiB))
    (root / "core-1.img").write_bytes(bytes([seed]) * 900)
    (root / "inventory.img").write_bytes(b"")
    (root / "kept").mkdir()
    (root / "kept" / "metrics.csv").write_text("step,loss\n1,0.5\n")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def commit(store: ObjectStore, sid: str, work: Path) -> None:
    with SnapshotWriter(store, sid, chunk_size=64 * KiB) as w:
        for s in STREAMS:
            w.add_directory(s, work / s)
        w.commit({"job": "a"})


class SlowStore(LocalDirStore):
    """A local directory whose reads take a while, one at a time: a fetch that lasts long
    enough to report progress on its way."""

    def __init__(self, root: Path, delay_s: float) -> None:
        super().__init__(root)
        self.delay_s = delay_s
        self._one = threading.Lock()

    def get_bytes(self, key: str) -> bytes:
        with self._one:
            time.sleep(self.delay_s)
        return super().get_bytes(key)


def thaws(home: Path, store: ObjectStore, copies: LocalCopies | None = None) -> Thaws:
    paths = Paths(home)
    jobs = JobTable("n0")
    freezes = Freezes("n0", paths, store, jobs, lambda: None, lambda plane: {}, 2, 0)
    return Thaws("n0", paths, store, jobs, Sandboxes(paths), RdzvHost("127.0.0.1"), freezes,
                 lambda: None, None, 2, copies)  # fmt: skip


def progress_of(events: list[agent_pb2.FetchEvent]) -> list[common_pb2.TransferProgress]:
    return [e.progress for e in events if e.HasField("progress")]


# ---- the reader ---------------------------------------------------------------------------


def test_fetch_and_extract_reports_every_raw_byte_it_verified(
    store: ObjectStore, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)
    reader = SnapshotReader(store, "job-a-0001")
    manifest = reader.manifest()
    assert all(len(manifest.streams[s].chunks) > 3 for s in STREAMS)
    seen: list[int] = []
    threads: set[str] = set()
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            seen.append(n)
            threads.add(threading.current_thread().name)

    out = reader.fetch_and_extract({s: tmp_path / "out" / s for s in STREAMS}, progress=count)
    assert all(tree(out[s]) == tree(work / s) for s in STREAMS)
    assert sum(seen) == sum(manifest.streams[s].raw_size for s in STREAMS)
    assert len(seen) == sum(len(manifest.streams[s].chunks) for s in STREAMS)
    # Only the streams asked for count.
    seen.clear()
    SnapshotReader(store, "job-a-0001").fetch_and_extract(
        {"rank-1": tmp_path / "one" / "rank-1"}, progress=count
    )
    assert sum(seen) == manifest.streams["rank-1"].raw_size


def test_a_progress_callback_that_raises_fails_the_fetch_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    store = LocalDirStore(tmp_path / "store")
    work = tmp_path / "work"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)

    def refuse(n: int) -> None:
        raise RuntimeError("the display broke")

    with pytest.raises(RuntimeError, match="the display broke"):
        SnapshotReader(store, "job-a-0001").fetch_and_extract(
            {s: tmp_path / "out" / s for s in STREAMS}, progress=refuse
        )
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_the_tar_size_is_known_before_the_stream_is_made(tmp_path: Path) -> None:
    root = images(tmp_path / "rank-0", seed=3)
    (root / ("long-name-" * 20)).write_bytes(os.urandom(513))  # a PAX path header
    (root / "kept" / "deeper").mkdir()
    os.link(root / "core-1.img", root / "kept" / "deeper" / "hard")  # a hard link: no data
    made = bytearray()

    class Sink:
        def write(self, data: bytes) -> int:
            made.extend(data)
            return len(data)

    dirstream.tar_directory(root, Sink())
    assert dirstream.tar_size(root) == len(made)
    empty = tmp_path / "empty"
    empty.mkdir()
    made.clear()
    dirstream.tar_directory(empty, Sink())
    assert dirstream.tar_size(empty) == len(made)


# ---- the agent's upload -------------------------------------------------------------------


def test_an_uploads_progress_counts_up_to_its_known_total(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    paths = Paths(tmp_path / "home")
    freezes = Freezes("n0", paths, store, JobTable("n0"), lambda: None, lambda plane: {}, 2, 0)
    fr = Freeze("frz-1", "job-a", paths.work_dir("frz-1"), phase=FreezePhase.DUMPED)
    for rank, s in enumerate(STREAMS):
        images(fr.work / s, seed=rank)
        fr.records[rank] = common_pb2.RankRecord(rank=rank, stream=s)
    freezes._freezes[fr.freeze_id] = fr  # what a dump leaves behind
    want = sum(dirstream.tar_size(fr.work / s) for s in STREAMS)

    events = list(freezes.upload("job-a", "frz-1", "job-a-0001"))
    progress = [e.progress for e in events if e.HasField("progress")]
    assert progress and events[-1].HasField("uploaded")
    uploaded = events[-1].uploaded
    assert want == sum(uploaded.streams[s].raw_size for s in STREAMS)
    for p in progress:
        assert p.node == "n0"
        assert p.total_bytes == want >= p.raw_bytes
    assert progress[-1].raw_bytes == want
    assert [p.raw_bytes for p in progress] == sorted(p.raw_bytes for p in progress)


# ---- the agent's fetch --------------------------------------------------------------------


def test_a_fetch_from_the_store_reports_progress_to_its_total(tmp_path: Path) -> None:
    store = SlowStore(tmp_path / "store", delay_s=0.03)
    work = tmp_path / "images"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)
    manifest = SnapshotReader(store, "job-a-0001").manifest()
    total = sum(manifest.streams[s].raw_size for s in STREAMS)
    stored = sum(manifest.streams[s].stored_size for s in STREAMS)
    assert sum(len(manifest.streams[s].chunks) for s in STREAMS) * 0.03 > 1.0  # lasts > 1 s

    node = thaws(tmp_path / "home", store)
    events = list(node.fetch("job-a-0001", STREAMS))
    assert events[0].phase.phase == "fetch" and events[-1].HasField("fetched")
    progress = progress_of(events)
    assert len(progress) >= 2  # on its way, and the end
    for p in progress:
        assert p.node == "n0" and p.total_bytes == total >= p.raw_bytes
    assert [p.raw_bytes for p in progress] == sorted(p.raw_bytes for p in progress)
    assert progress[0].raw_bytes < total
    assert progress[-1].raw_bytes == total and progress[-1].stored_bytes == stored
    assert progress[-1].rate > 0
    assert not events[-1].fetched.local_copy
    got = node.paths.work_dir(events[-1].fetched.op)
    assert all(tree(got / s) == tree(work / s) for s in STREAMS)


def test_a_fetch_from_the_local_copy_reports_its_end(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    home = tmp_path / "home"
    work = home / "work" / "frz-1"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)
    copies = LocalCopies(Paths(home).copies_dir, cap_bytes=1 << 30)
    assert copies.keep("job-a", "job-a-0001", work, STREAMS)
    manifest = SnapshotReader(store, "job-a-0001").manifest()
    total = sum(manifest.streams[s].raw_size for s in STREAMS)

    events = list(thaws(home, store, copies).fetch("job-a-0001", STREAMS))
    assert events[-1].fetched.local_copy
    progress = progress_of(events)
    assert [(p.raw_bytes, p.total_bytes) for p in progress] == [(total, total)]


def test_a_failed_fetch_raises_as_before_and_leaves_no_work_dir(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    work = tmp_path / "images"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)
    victim = SnapshotReader(store, "job-a-0001").manifest().streams["rank-1"].chunks[2]
    (tmp_path / "store" / victim.key).write_bytes(b"not the chunk")

    home = tmp_path / "home"
    events: list[agent_pb2.FetchEvent] = []
    with pytest.raises(SnapshotCorrupt, match="chunk 2"):
        for ev in thaws(home, store).fetch("job-a-0001", STREAMS):
            events.append(ev)
    assert not any(e.HasField("fetched") for e in events)
    assert all(p.raw_bytes < p.total_bytes for p in progress_of(events))
    assert list((home / "work").iterdir()) == []


def test_a_fetch_closed_early_waits_for_its_worker_and_removes_its_files(
    tmp_path: Path,
) -> None:
    store = SlowStore(tmp_path / "store", delay_s=0.03)
    work = tmp_path / "images"
    for i, s in enumerate(STREAMS):
        images(work / s, seed=i)
    commit(store, "job-a-0001", work)
    home = tmp_path / "home"
    fetch: Iterator[agent_pb2.FetchEvent] = thaws(home, store).fetch("job-a-0001", STREAMS)
    for ev in fetch:
        if ev.HasField("progress"):
            break  # the coordinator went away mid-fetch
    fetch.close()  # type: ignore[attr-defined]
    assert not [t for t in threading.enumerate() if t.name.startswith("fetch-thaw-")]
    assert list((home / "work").iterdir()) == []


# ---- the agent's receive (a migration straight from another node) ------------------------


class SlowSource(agent_pb2_grpc.AgentServicer):
    """A migrating node's agent, as far as its images go: the real image stream of each
    rank's directory, each file's data a while after its header."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def ReadImages(
        self, req: agent_pb2.ImagesRequest, ctx: grpc.ServicerContext
    ) -> Iterator[agent_pb2.ImagePiece]:
        for piece in handoff.pieces(self.root / req.stream):
            if piece.data:
                time.sleep(0.4)
            yield piece


def test_a_receive_reports_progress_to_the_images_size(tmp_path: Path) -> None:
    src = tmp_path / "source"
    for i, s in enumerate(STREAMS):
        images(src / s, seed=i)
    size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
    server = grpc.server(ThreadPoolExecutor(4))
    agent_pb2_grpc.add_AgentServicer_to_server(SlowSource(src), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        node = thaws(tmp_path / "home", LocalDirStore(tmp_path / "store"))
        events = list(node.receive(f"127.0.0.1:{port}", "a", "job-a", "frz-1", "t", STREAMS, size))
    finally:
        server.stop(0)
    assert events[0].phase.phase == "receive" and events[-1].HasField("fetched")
    progress = progress_of(events)
    assert len(progress) >= 2
    for p in progress:
        assert p.node == "n0" and p.total_bytes == size >= p.raw_bytes
    assert progress[-1].raw_bytes == size
    got = node.paths.work_dir(events[-1].fetched.op)
    assert all(tree(got / s) == tree(src / s) for s in STREAMS)
