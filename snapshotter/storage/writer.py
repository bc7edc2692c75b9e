"""Writing a snapshot: stream images into compressed, hashed chunks, then commit a manifest.

    with SnapshotWriter(store, "job1-0001") as w:
        w.add_directory("rank-0", "/var/lib/snapshotter/images/rank-0")
        w.write_stream("rank-0-meta", open(path, "rb"))
        manifest = w.commit({"job": ...})

Streams are read in `chunk_size` pieces; each piece is compressed, hashed and uploaded on a
worker thread, with at most `2 * workers` pieces in flight, so memory stays a few chunks
whatever the image size. A directory is streamed as an uncompressed tar ('w|') through a pipe,
never materialised. `commit` checks every chunk is in the store with the expected size and only
then writes the manifest; anything short of that leaves no visible snapshot, and `abort` (also
run on leaving the `with` block without a commit) deletes the chunks written so far. This module
must never write the manifest before every chunk is confirmed stored.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import zstandard

from snapshotter.errors import InvalidArgument, StorageUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.commit import commit_snapshot
from snapshotter.storage.dirstream import tar_directory
from snapshotter.storage.tasks import TransferStatus, TransferTasks

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 8 * 1024 * 1024
DEFAULT_WORKERS = 4
ZSTD_LEVEL = 3
_PIPE_SIZE = 1024 * 1024


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
    ) -> None:
        _valid_name(snapshot_id, "snapshot id")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        if store.head(fmt.manifest_key(snapshot_id)) is not None:
            raise InvalidArgument(
                f"snapshot {snapshot_id!r} already exists in {store.describe()}",
                "choose a new snapshot id, or delete the old snapshot first",
            )
        self.store = store
        self.snapshot_id = snapshot_id
        self.chunk_size = chunk_size
        self._progress = progress
        self._workers = workers
        self._tasks = TransferTasks(workers, 2 * workers, name=f"snap-{snapshot_id}")
        self._lock = threading.Lock()
        self._streams: dict[str, fmt.StreamInfo | None] = {}  # None while being written
        self._written: set[str] = set()  # every key we may have created, for abort
        self._undeleted: list[str] = []
        self._raw_total = 0
        self._stored_total = 0
        self._stream_bytes: dict[str, tuple[int, int, int]] = {}
        self._started = time.monotonic()
        self._local = threading.local()
        self.committed: fmt.Manifest | None = None
        self._tasks.add_cleanup(self._delete_written)

    # -- streams --------------------------------------------------------------------------

    def write_stream(self, name: str, fileobj: Readable) -> fmt.StreamInfo:
        """Read `fileobj` to EOF and store it as stream `name`; return what was stored."""
        self._begin_stream(name)
        futures: list[Future[fmt.ChunkInfo]] = []
        try:
            for index in range(fmt.MAX_CHUNKS):
                data = _read_chunk(fileobj, self.chunk_size)
                if not data:
                    break
                key = fmt.chunk_key(self.snapshot_id, name, index)
                with self._lock:
                    self._written.add(key)  # before the PUT: a failed PUT may still land
                # The task takes the buffer out of the holder, so the buffer is freed when the
                # task returns and memory stays at the chunks in flight.
                holder = [data]
                del data
                futures.append(self._tasks.submit(self._store_chunk, name, index, key, holder))
            else:
                raise InvalidArgument(
                    f"stream {name!r} exceeds {fmt.MAX_CHUNKS} chunks of {self.chunk_size} bytes",
                    "use a larger chunk_size",
                )
            wait_futures(futures)
            self._tasks.raise_if_failed()
        except BaseException as e:
            self._tasks.set_exception(e)
            wait_futures(futures)
            raise
        chunks = tuple(f.result() for f in futures)
        info = fmt.StreamInfo(
            name=name,
            raw_size=sum(c.raw_size for c in chunks),
            chunk_size=self.chunk_size,
            chunks=chunks,
        )
        with self._lock:
            self._streams[name] = info
        return info

    def add_directory(self, name: str, path: str | os.PathLike[str]) -> fmt.StreamInfo:
        """Store the tree under `path` as stream `name`, an uncompressed tar with paths
        relative to `path`, produced on the fly through a pipe."""
        root = Path(path)
        if not root.is_dir():
            raise InvalidArgument(f"{root} is not a directory", "pass the CRIU images directory")
        r, w = os.pipe()
        try:
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:
            pass  # a smaller pipe is only slower
        reader, writer = os.fdopen(r, "rb"), os.fdopen(w, "wb")
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                tar_directory(root, writer)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer below
                failure.append(e)
            finally:
                try:
                    writer.close()
                except OSError:
                    pass  # the consumer stopped reading; its error is the one to report

        producer = threading.Thread(target=produce, name=f"tar-{name}", daemon=True)
        producer.start()
        try:
            info = self.write_stream(name, reader)
        finally:
            reader.close()  # unblocks the producer with EPIPE if we stopped early
            producer.join()
        if failure:
            # The pipe closed early, so the stream looked complete: poison the transfer so a
            # truncated directory can never be committed.
            self._tasks.set_exception(failure[0])
            raise failure[0]
        return info

    def _begin_stream(self, name: str) -> None:
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

    def _store_chunk(
        self, stream: str, index: int, key: str, holder: list[bytearray]
    ) -> fmt.ChunkInfo:
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
        self._report(stream, info)
        return info

    def _compressor(self) -> zstandard.ZstdCompressor:
        # A ZstdCompressor must not be shared between threads; one per worker is cheap.
        c: zstandard.ZstdCompressor | None = getattr(self._local, "cctx", None)
        if c is None:
            c = self._local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        return c

    def _report(self, stream: str, c: fmt.ChunkInfo) -> None:
        with self._lock:
            raw, stored, n = self._stream_bytes[stream]
            raw, stored, n = raw + c.raw_size, stored + c.stored_size, n + 1
            self._stream_bytes[stream] = (raw, stored, n)
            self._raw_total += c.raw_size
            self._stored_total += c.stored_size
            p = Progress(
                self.snapshot_id,
                stream,
                raw,
                stored,
                self._raw_total,
                self._stored_total,
                n,
                time.monotonic() - self._started,
            )
            if self._progress is None:
                return
            try:
                self._progress(p)
            except Exception as e:  # noqa: BLE001 - a display problem must not fail a freeze
                log.warning("progress callback failed: %s", e)

    # -- commit / abort -------------------------------------------------------------------

    def commit(self, meta: Mapping[str, Any]) -> fmt.Manifest:
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
        try:
            manifest = commit_snapshot(self.store, self.snapshot_id, streams, meta)
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
