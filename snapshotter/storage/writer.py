"""Writing a snapshot: cut streams into chunks, store each content once, commit a manifest.

    with SnapshotWriter(store, "job1-0001", seed=previous_streams) as w:
        w.add_directory("rank-0", "/var/lib/snapshotter/images/rank-0")
        w.write_stream("rank-0-meta", open(path, "rb"))
        manifest = w.commit({"job": ...})

Format 2 (the default): a stream is cut by content at page boundaries (chunking.py); each chunk
is looked up in the dedup index (dedup.py: the job's previous snapshot, this writer's chunks, then
a HEAD on its content key) and only content the store lacks is encoded (codec.py) and uploaded,
under `chunks/<sha256>`, shared by every snapshot that has it. Format 1 (SNAPSHOTTER_FORMAT_VERSION
=1): fixed-size zstd chunks under the snapshot's own prefix, as before.

Chunks are hashed, encoded and uploaded on worker threads, with at most `2 * workers` in flight,
so memory stays a few chunks whatever the image size. A directory is an uncompressed tar made on
the fly (dirstream.py), its large files' data anchored on page boundaries. `commit` checks every
chunk is in the store and only then writes the manifest; anything short of that leaves no
visible snapshot. `abort` (also run on leaving the `with` block without a commit) deletes what
only this snapshot can use (format 1's chunks, a manifest); format 2's content may be shared
with a concurrent writer that found it, so it is left to `snapshotter gc` (unreferenced and
older than its grace period). This module must never write the manifest before every chunk is
confirmed stored.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import xxhash
import zstandard

from snapshotter import config
from snapshotter.errors import InvalidArgument, StorageUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.chunking import PAGE, Chunker, ChunkingParams, FixedChunker
from snapshotter.storage.codec import Codec, CodecPolicy
from snapshotter.storage.commit import commit_snapshot
from snapshotter.storage.dedup import DedupIndex
from snapshotter.storage.dirstream import tar_directory
from snapshotter.storage.sealing import Seal
from snapshotter.storage.signing import Signer
from snapshotter.storage.tasks import TransferStatus, TransferTasks

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024
DEFAULT_WORKERS = 4
ZSTD_LEVEL = 3  # format 1
_READ_SIZE = 1024 * 1024


@dataclass(frozen=True)
class Progress:
    """Reported after each chunk is stored; bytes are cumulative."""

    snapshot_id: str
    stream: str
    stream_raw_bytes: int
    stream_stored_bytes: int
    total_raw_bytes: int
    total_stored_bytes: int
    chunks_stored: int
    elapsed_s: float
    uploaded_bytes: int = 0  # stored bytes actually sent (the rest were found stored)

    @property
    def raw_rate(self) -> float:
        """Raw bytes per second over the whole snapshot so far."""
        return self.total_raw_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0


ProgressFn = Callable[[Progress], None]


class Readable(Protocol):
    """What `write_stream` reads from: any binary file-like object (`readinto` is used when
    present, to avoid a copy)."""

    def read(self, size: int = ..., /) -> bytes | None: ...


class SnapshotWriter:
    """Writes one snapshot. Streams may be written from several threads at once.

    Raises (from its methods):
        StorageUnavailable: the store failed; the snapshot is not committed (call `abort`).
        InvalidArgument: a bad snapshot id / stream name, a duplicate stream, non-JSON meta,
            or a snapshot id that is already committed.
    """

    def __init__(
        self,
        store: ObjectStore,
        snapshot_id: str,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        workers: int = DEFAULT_WORKERS,
        progress: ProgressFn | None = None,
        format_version: int | None = None,
        codec: CodecPolicy | None = None,
        seed: Iterable[fmt.StreamInfo] = (),
        seal: Seal | None = None,
    ) -> None:
        """`chunk_size`: format 1's chunk size, format 2's largest chunk. `format_version` and
        `codec`: default from the environment (config.py). `seed`: streams of the job's
        previous snapshot, whose chunks need no hashing or request when unchanged. `seal`:
        the tenant data key every chunk is sealed with (sealing.py); chunks are then named
        by keyed digests and the manifest must be committed with `sealed=`."""
        _valid_name(snapshot_id, "snapshot id")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.format_version = format_version or config.format_version()
        if self.format_version not in fmt.READ_VERSIONS:
            raise ValueError(f"unknown format version {self.format_version}")
        if seal is not None:
            self.format_version = fmt.SEALED_VERSION  # only content chunks can be sealed
        if self.format_version >= 2:
            self._chunking = ChunkingParams(
                min_size=min(ChunkingParams.min_size, _page_floor(chunk_size)),
                max_size=_page_floor(chunk_size),
            )
        if store.head(fmt.manifest_key(snapshot_id)) is not None:
            raise InvalidArgument(
                f"snapshot {snapshot_id!r} already exists in {store.describe()}",
                "choose a new snapshot id, or delete the old snapshot first",
            )
        self.store = store
        self.snapshot_id = snapshot_id
        self.chunk_size = chunk_size
        self._codec = Codec(codec or config.codec_policy())
        self.seal = seal
        self._index = DedupIndex()
        self.seeded = self._index.seed(seed)
        self._progress = progress
        self._workers = workers
        self._tasks = TransferTasks(workers, 2 * workers, name=f"snap-{snapshot_id}")
        self._lock = threading.Lock()
        self._streams: dict[str, fmt.StreamInfo | None] = {}  # None while being written
        self._written: set[str] = set()  # every key only we may have created, for abort
        self._put: set[str] = set()  # shared chunks this writer PUT (the store acknowledged)
        self._undeleted: list[str] = []
        self._raw_total = 0
        self._stored_total = 0
        self._uploaded_total = 0
        self.deduped_chunks = 0
        self.uploaded_chunks = 0
        self._stream_bytes: dict[str, tuple[int, int, int]] = {}
        self._started = time.monotonic()
        self._local = threading.local()
        self.committed: fmt.Manifest | None = None
        self._tasks.add_cleanup(self._delete_written)

    @property
    def put_keys(self) -> list[str]:
        """The shared chunks this writer uploaded, acknowledged by the store: a commit need
        not ask for them again (`commit_snapshot(put_now=...)`)."""
        with self._lock:
            return sorted(self._put)

    @property
    def uploaded_bytes(self) -> int:
        """Stored bytes this writer sent to the store (chunks found stored cost nothing)."""
        with self._lock:
            return self._uploaded_total

    # -- streams --------------------------------------------------------------------------

    def write_stream(self, name: str, fileobj: Readable) -> fmt.StreamInfo:
        """Read `fileobj` to EOF and store it as stream `name`; return what was stored."""
        out = self._open_stream(name)
        try:
            while True:
                piece = _read_chunk(fileobj, _READ_SIZE)
                if not piece:
                    break
                out.feed(piece)
        except BaseException as e:
            out.fail(e)
            raise
        return out.close()

    def add_directory(self, name: str, path: str | os.PathLike[str]) -> fmt.StreamInfo:
        """Store the tree under `path` as stream `name`, an uncompressed tar with paths
        relative to `path`, made on the fly."""
        root = Path(path)
        if not root.is_dir():
            raise InvalidArgument(f"{root} is not a directory", "pass the CRIU images directory")
        out = self._open_stream(name)
        try:
            tar_directory(root, out, on_file=out.mark)
        except BaseException as e:
            # A stream cut short must never be committed: poison the whole transfer.
            out.fail(e)
            raise
        return out.close()

    def _open_stream(self, name: str) -> _StreamOut:
        _valid_name(name, "stream name")
        self._tasks.raise_if_failed()
        with self._lock:
            if name in self._streams:
                raise InvalidArgument(
                    f"stream {name!r} written twice to snapshot {self.snapshot_id!r}",
                    "give every stream a unique name",
                )
            self._streams[name] = None
            self._stream_bytes[name] = (0, 0, 0)
        chunker: Chunker | FixedChunker
        if self.format_version >= 2:
            chunker = Chunker(self._chunking)
        else:
            chunker = FixedChunker(self.chunk_size)
        return _StreamOut(self, name, chunker)

    def _submit(self, stream: str, index: int, holder: list[bytearray]) -> Future[fmt.ChunkInfo]:
        if index >= fmt.MAX_CHUNKS:
            raise InvalidArgument(
                f"stream {stream!r} exceeds {fmt.MAX_CHUNKS} chunks", "use a larger chunk_size"
            )
        if self.format_version >= 2:
            return self._tasks.submit(self._store_content, stream, index, holder)
        key = fmt.chunk_key(self.snapshot_id, stream, index)
        with self._lock:
            self._written.add(key)  # before the PUT: a failed PUT may still land
        return self._tasks.submit(self._store_chunk, stream, index, key, holder)

    def _finish_stream(self, name: str, chunks: tuple[fmt.ChunkInfo, ...]) -> fmt.StreamInfo:
        info = fmt.StreamInfo(
            name=name,
            raw_size=sum(c.raw_size for c in chunks),
            chunk_size=self.chunk_size,
            chunks=chunks,
            chunking=fmt.CONTENT if self.format_version >= 2 else fmt.FIXED,
        )
        with self._lock:
            self._streams[name] = info
        return info

    def _store_content(self, stream: str, index: int, holder: list[bytearray]) -> fmt.ChunkInfo:
        """Format 2: store one chunk's content unless the store has it already."""
        data = holder.pop()
        fast = xxhash.xxh3_128_hexdigest(data)
        if self.seal is not None:
            fast = self.seal.fast(fast)
        hit = self._index.fast(fast, len(data))
        if hit is not None:
            info = replace(hit, index=index)
            self._report(stream, info, 0)
            return info
        sha = fmt.sha256_hex(data)
        if self.seal is not None:
            sha = self.seal.digest(sha)
        key = fmt.content_key(sha)
        uploaded = 0
        while (size := self._index.stored_size(key)) is None:
            if not self._index.claim(key):
                continue  # another worker settled it: stored (size known now) or failed
            try:
                size = self.store.head(key)
                if size is None:
                    stored = self._codec.encode(data)
                    if self.seal is not None:
                        stored = self.seal.seal(key, stored)
                    self.store.put_bytes(key, stored)
                    size = uploaded = len(stored)
                    with self._lock:
                        self._put.add(key)
            except BaseException:
                self._index.settle(None, key)
                raise
            self._index.settle(fmt.ChunkInfo(index, key, len(data), size, "", sha, fast), key)
            break
        info = fmt.ChunkInfo(index, key, len(data), size, "", sha, fast)
        self._index.add(info)
        self._report(stream, info, uploaded)
        return info

    def _store_chunk(
        self, stream: str, index: int, key: str, holder: list[bytearray]
    ) -> fmt.ChunkInfo:
        """Format 1: every chunk compressed and stored under the snapshot's own prefix."""
        data = holder.pop()
        stored = self._compressor().compress(data)
        info = fmt.ChunkInfo(
            index=index,
            key=key,
            raw_size=len(data),
            stored_size=len(stored),
            sha256=fmt.sha256_hex(stored),
            raw_sha256=fmt.sha256_hex(data),
        )
        self.store.put_bytes(key, stored)
        self._report(stream, info, len(stored))
        return info

    def _compressor(self) -> zstandard.ZstdCompressor:
        # A ZstdCompressor must not be shared between threads; one per worker is cheap.
        c: zstandard.ZstdCompressor | None = getattr(self._local, "cctx", None)
        if c is None:
            c = self._local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return c

    def _report(self, stream: str, c: fmt.ChunkInfo, uploaded: int) -> None:
        with self._lock:
            raw, stored, n = self._stream_bytes[stream]
            raw, stored, n = raw + c.raw_size, stored + c.stored_size, n + 1
            self._stream_bytes[stream] = (raw, stored, n)
            self._raw_total += c.raw_size
            self._stored_total += c.stored_size
            self._uploaded_total += uploaded
            if uploaded:
                self.uploaded_chunks += 1
            else:
                self.deduped_chunks += 1
            p = Progress(
                self.snapshot_id,
                stream,
                raw,
                stored,
                self._raw_total,
                self._stored_total,
                n,
                time.monotonic() - self._started,
                self._uploaded_total,
            )
            if self._progress is None:
                return
            try:
                self._progress(p)
            except Exception as e:  # noqa: BLE001 - a display problem must not fail a freeze
                log.warning("progress callback failed: %s", e)

    # -- commit / abort -------------------------------------------------------------------

    def commit(self, meta: Mapping[str, Any], signer: Signer | None = None) -> fmt.Manifest:
        """Verify every chunk is stored, then write the manifest: the snapshot now exists.
        The same commit the coordinator makes of every node's streams (commit.py).

        Raises:
            StorageUnavailable: a chunk is missing or has the wrong size in the store, or the
                manifest could not be written. Nothing is committed; call `abort`.
            InvalidArgument: `meta` is not JSON-serializable, or a stream is still being
                written.
        """
        self._tasks.raise_if_failed()
        with self._lock:
            pending = [n for n, s in self._streams.items() if s is None]
            if pending:
                raise InvalidArgument(
                    f"cannot commit snapshot {self.snapshot_id!r}: streams {pending} unfinished",
                    "wait for every write_stream/add_directory to return before commit",
                )
            streams = {n: s.to_dict() for n, s in self._streams.items() if s is not None}
            self._written.add(fmt.manifest_key(self.snapshot_id))
            self._written.add(fmt.signature_key(self.snapshot_id))
        try:
            sealed = None if self.seal is None else fmt.Sealing(self.seal.tenant, self.seal.key_id)
            manifest = commit_snapshot(
                self.store,
                self.snapshot_id,
                streams,
                meta,
                put_now=self._put,
                signer=signer,
                sealed=sealed,
            )
        except StorageUnavailable as err:
            self._tasks.set_exception(err)
            raise
        self._tasks.done()
        self.committed = manifest
        return manifest

    def release(self) -> None:
        """Release the worker threads, keeping every chunk written: for a writer whose streams
        are committed elsewhere (the coordinator's commit_snapshot gathers every node's). A
        later `abort` still deletes the chunks; without one they are a committed snapshot's,
        or orphans for `snapshotter gc`."""
        self._tasks.release_workers()

    def abort(self) -> list[str]:
        """Give up on this snapshot: wait for running uploads, delete every chunk written so
        far (best effort). Returns the keys that could not be deleted (left for gc). After a
        successful commit this does nothing: delete a committed snapshot with
        `delete_snapshot`."""
        if self._tasks.status is TransferStatus.DONE:
            return []
        self._tasks.abort()
        return list(self._undeleted)

    def _delete_written(self) -> None:
        with self._lock:
            # The manifest first (if a commit got that far), so the snapshot is invisible
            # before any of its chunks go.
            mkey = fmt.manifest_key(self.snapshot_id)
            keys = sorted(self._written - {mkey})
            first = [mkey] if mkey in self._written else []
        try:
            undeleted = self.store.delete_keys(first)
            if not undeleted:
                undeleted = self.store.delete_keys(keys)
            else:
                undeleted += keys
        except StorageUnavailable as e:
            log.warning("abort of snapshot %s could not delete its chunks: %s", self.snapshot_id, e)
            undeleted = first + keys
        if undeleted:
            log.warning(
                "abort of snapshot %s left %d object(s) in %s for gc, e.g. %s",
                self.snapshot_id,
                len(undeleted),
                self.store.describe(),
                undeleted[0],
            )
        self._undeleted = undeleted

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._tasks.status is not TransferStatus.DONE:
            if exc is None:
                log.warning("snapshot %s left without commit; aborting", self.snapshot_id)
            self.abort()


class _StreamOut:
    """One stream being written: bytes in (`feed`, or `write` from a tar), chunks out to the
    writer's workers in order. Also a write-only file for `tar_directory` (`write`, `tell`,
    `mark` where a file's data starts)."""

    def __init__(self, writer: SnapshotWriter, name: str, chunker: Chunker | FixedChunker):
        self.w = writer
        self.name = name
        self.chunker = chunker
        self.futures: list[Future[fmt.ChunkInfo]] = []
        self.pos = 0

    def _push(self, chunks: Iterator[bytearray]) -> None:
        for data in chunks:
            # The task takes the buffer out of the holder, so the buffer is freed when the
            # task returns and memory stays at the chunks in flight.
            holder = [data]
            del data
            self.futures.append(self.w._submit(self.name, len(self.futures), holder))

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self.pos += len(data)
        self._push(self.chunker.feed(data))

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.feed(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def mark(self, size: int) -> None:
        self._push(self.chunker.mark(size))

    def fail(self, e: BaseException) -> None:
        self.w._tasks.set_exception(e)
        wait_futures(self.futures)

    def close(self) -> fmt.StreamInfo:
        try:
            self._push(self.chunker.finish())
            wait_futures(self.futures)
            self.w._tasks.raise_if_failed()
        except BaseException as e:
            self.fail(e)
            raise
        return self.w._finish_stream(self.name, tuple(f.result() for f in self.futures))


def _page_floor(n: int) -> int:
    return max(PAGE, n - n % PAGE)


def _valid_name(name: str, what: str) -> None:
    try:
        fmt.validate_name(name, what)
    except ValueError as e:
        raise InvalidArgument(str(e), f"pick a {what} from safe characters") from e


def _read_chunk(f: Readable, n: int) -> bytearray:
    """Read exactly `n` bytes into one fresh buffer, or fewer only at EOF (pipes and
    generators return short reads). One allocation per chunk, no intermediate copies."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(view[got:])
        else:
            piece = f.read(n - got) or b""
            k = len(piece)
            view[got : got + k] = piece
        if not k:
            break
        got += k
    view.release()
    if got < n:
        del buf[got:]
    return buf
