"""Reading a snapshot back: verify every chunk first, restore nothing until all are good.

    reader = SnapshotReader(store, "job1-0001")
    reader.verify_and_fetch(staging_dir, streams=["rank-0", "rank-1"], decompress=False)
    reader.extract_directories({"rank-0": dest / "rank-0", "rank-1": dest / "rank-1"})

`verify_and_fetch` downloads chunks in parallel and checks each one's size and sha256 against
the manifest. By default it also decompresses each chunk, checks its raw size and sha256, and
writes it at its offset into `<staging>/<stream>.stream`. With `decompress=False` it keeps the
verified chunks as stored, back to back in `<staging>/<stream>.zst` (CRIU images compress about
5x, so this is that much less staging I/O), and `extract_directory` decompresses them while it
untars, checking each chunk's raw size and sha256 before the archive reader sees any of its
bytes. Either way `verify_and_fetch` returns only once every chunk of every requested stream
checked out; on the first bad chunk it stops, removes the staged files and raises
`SnapshotCorrupt` naming snapshot, stream, chunk and key. Only then may a caller extract, and
extraction refuses tar members that would land outside the target (absolute paths, '..', links,
devices), works in a sibling temp directory renamed into place only after the whole stream
verified, and leaves nothing behind on failure. This module must never hand out, or move into
place, bytes that were not verified.
"""

from __future__ import annotations

import io
import os
import queue
import shutil
import tarfile
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from snapshotter.errors import (
    InvalidArgument,
    KeyUnavailable,
    SnapshotCorrupt,
    SnapshotNotFound,
    SnapshotUntrusted,
    StorageUnavailable,
)
from snapshotter.storage import dirstream, signing
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectMissing, ObjectStore
from snapshotter.storage.catalog import snapshots_using
from snapshotter.storage.codec import Codec, CodecError
from snapshotter.storage.sealing import Seal, SealError
from snapshotter.storage.tasks import TransferTasks

DEFAULT_WORKERS = 4
STAGED_SUFFIX = ".stream"
STAGED_COMPRESSED_SUFFIX = ".zst"
_CHUNKS_AHEAD = 1

FetchProgressFn = Callable[[str, int, int], None]  # (stream, chunks verified, chunks in stream)


@dataclass(frozen=True)
class _Staged:
    path: Path
    compressed: bool  # True: the stored chunks back to back; False: the raw stream


class _Cancelled(Exception):
    """Another stream of the same `extract_directories` failed; this one stops too."""


class SnapshotReader:
    """Reads one committed snapshot. Different streams may be extracted from several threads
    at once.

    Raises (from its methods):
        SnapshotNotFound: no committed snapshot with this id (no manifest).
        SnapshotCorrupt: the manifest or a chunk is damaged or missing.
        StorageUnavailable: the store failed.
        InvalidArgument: an unknown stream, or extraction before verification.
    """

    def __init__(
        self, store: ObjectStore, snapshot_id: str, *, workers: int = DEFAULT_WORKERS,
        uncommitted: Mapping[str, Mapping[str, Any]] | None = None,
        digest: str = "",
        seal: Seal | None = None,
    ) -> None:
        """`uncommitted`: read these streams (as `StreamInfo.to_dict()`) of a snapshot that
        has no manifest (a migration through the store); every chunk is checked the same.
        `digest`: the sha256 of the manifest bytes whose signature a thaw checked
        (signing.manifest_digest); a manifest with other bytes is refused. `seal`: the data
        key a sealed snapshot (or sealed uncommitted streams) needs (sealing.py)."""
        try:
            fmt.validate_name(snapshot_id)
        except ValueError as e:
            raise InvalidArgument(str(e), "run `snapshotter list` for valid ids") from e
        self.store = store
        self.snapshot_id = snapshot_id
        self.workers = workers
        self._manifest: fmt.Manifest | None = None
        self._digest = digest
        self._body: bytes | None = None
        if uncommitted is not None:
            try:
                streams = {n: fmt.stream_from_dict(n, s) for n, s in uncommitted.items()}
            except (fmt.ManifestError, KeyError, TypeError, ValueError) as e:
                raise SnapshotCorrupt(
                    f"the chunk list of {snapshot_id!r} is malformed: {e}", _CORRUPT_NEXT_STEP
                ) from e
            for s in streams.values():
                try:
                    fmt.validate_stream(snapshot_id, s)
                except ValueError as e:
                    raise SnapshotCorrupt(
                        f"stream {s.name} of {snapshot_id!r}: {e} (a key outside the snapshot "
                        "or its content)", _CORRUPT_NEXT_STEP,
                    ) from e  # fmt: skip
            self._manifest = fmt.Manifest(snapshot_id, 0.0, {}, streams)
        self._lock = threading.Lock()
        self._staged: dict[str, _Staged] = {}
        self._codec = Codec()
        self._seal = seal
        self._locked: KeyUnavailable | None = None
        # The key chunks are opened with: set once the manifest says it is sealed.
        self._opener: Seal | None = seal if uncommitted is not None else None

    def manifest_body(self) -> bytes:
        """The manifest's stored bytes, as signed; read once, and `manifest` is parsed from
        these very bytes (a thaw checks their signature, then reads the manifest)."""
        if self._body is None:
            try:
                self._body = self.store.get_bytes(fmt.manifest_key(self.snapshot_id))
            except ObjectMissing as e:
                raise SnapshotNotFound(self.snapshot_id, self.store.describe()) from e
        return self._body

    def signature(self) -> bytes | None:
        """The manifest's signature object (signing.py), None when unsigned."""
        try:
            return self.store.get_bytes(fmt.signature_key(self.snapshot_id))
        except ObjectMissing:
            return None

    def manifest(self) -> fmt.Manifest:
        if self._manifest is None:
            key = fmt.manifest_key(self.snapshot_id)
            data = self.manifest_body()
            if self._digest and signing.manifest_digest(data) != self._digest:
                raise SnapshotUntrusted(
                    f"the manifest of snapshot {self.snapshot_id!r} in {self.store.describe()} "
                    "changed after the coordinator checked its signature",
                    "thaw again; if it repeats, find out who writes to the store",
                )
            try:
                m = fmt.Manifest.from_json(data)
            except fmt.ManifestError as e:
                raise SnapshotCorrupt(
                    f"snapshot {self.snapshot_id!r} in {self.store.describe()}: manifest {key} "
                    f"is unreadable: {e}",
                    _CORRUPT_NEXT_STEP,
                ) from e
            if m.snapshot_id != self.snapshot_id:
                raise SnapshotCorrupt(
                    f"manifest {key} in {self.store.describe()} describes snapshot "
                    f"{m.snapshot_id!r}, not {self.snapshot_id!r}",
                    _CORRUPT_NEXT_STEP,
                )
            self._opener = self._check_sealing(m)
            self._manifest = m
        return self._manifest

    def _check_sealing(self, m: fmt.Manifest) -> Seal | None:
        """The key to open `m`'s chunks with; a wrong key fails now, a missing one when the
        first chunk is read (its manifest is readable without: listing, gc)."""
        if m.sealed is None:
            return None
        want = f"data key {m.sealed.key_id} of tenant {m.sealed.tenant!r}"
        if self._seal is None:
            self._locked = KeyUnavailable(
                f"snapshot {self.snapshot_id!r} is encrypted under {want}, and no key was given",
                "thaw it through the coordinator that holds the tenant's keys",
            )
            return None
        if (self._seal.tenant, self._seal.key_id) != (m.sealed.tenant, m.sealed.key_id):
            raise KeyUnavailable(
                f"snapshot {self.snapshot_id!r} is encrypted under {want}, not under the "
                f"given data key {self._seal.key_id} of tenant {self._seal.tenant!r}",
                "thaw it through the coordinator that holds the tenant's keys",
            )
        return self._seal

    # -- phase one: download and verify ---------------------------------------------------

    def verify_and_fetch(
        self,
        dest_dir: str | os.PathLike[str],
        streams: Iterable[str] | None = None,
        progress: FetchProgressFn | None = None,
        *,
        decompress: bool = True,
    ) -> dict[str, Path]:
        """Download and verify every chunk of `streams` (default: all); return {stream: staged
        file}. The staged file is the raw stream, `<dest_dir>/<stream>.stream`, or with
        `decompress=False` the verified compressed chunks, `<dest_dir>/<stream>.zst`, whose raw
        checks `extract_directory` makes as it decompresses."""
        manifest = self.manifest()
        names = list(manifest.streams) if streams is None else list(streams)
        unknown = [n for n in names if n not in manifest.streams]
        if unknown:
            raise InvalidArgument(
                f"snapshot {self.snapshot_id!r} has no stream(s) {unknown}",
                f"its streams are {sorted(manifest.streams)}",
            )
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        # Shared content chunks are decoded as they arrive (their raw sha256 is their key, so
        # that is where they are checked): such streams are always staged raw.
        raw = {n: decompress or _content(manifest.streams[n]) for n in names}
        paths = {
            n: dest / f"{n}{STAGED_SUFFIX if raw[n] else STAGED_COMPRESSED_SUFFIX}" for n in names
        }
        fds: dict[str, int] = {}
        tasks = TransferTasks(
            self.workers, 2 * self.workers, name=f"fetch-{self.snapshot_id}"
        )
        tasks.add_cleanup(lambda: _unlink_all(paths.values()))
        counts = {n: 0 for n in names}

        def fetch(stream: fmt.StreamInfo, chunk: fmt.ChunkInfo, offset: int) -> None:
            if chunk.content_addressed:
                data = self._fetch_content(stream, chunk)
            else:
                data = self._fetch_stored(stream, chunk)
                if raw[stream.name]:
                    data = self._decompress(stream, chunk, data)
            _pwrite_all(fds[stream.name], data, offset)
            if progress is not None:
                counts[stream.name] += 1  # benign race: display only
                progress(stream.name, counts[stream.name], len(stream.chunks))

        try:
            for n in names:
                s = manifest.streams[n]
                fds[n] = os.open(paths[n], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fds[n], s.raw_size if raw[n] else s.stored_size)
            for n in names:
                s = manifest.streams[n]
                offset = 0
                for c in s.chunks:
                    tasks.submit(fetch, s, c, s.offset(c.index) if raw[n] else offset)
                    offset += c.stored_size
            tasks.wait()
        except BaseException:
            tasks.abort()  # waits for running fetches before their files are closed/removed
            _close_all(fds.values())
            raise
        _close_all(fds.values())
        tasks.done()
        with self._lock:
            self._staged.update({n: _Staged(p, not raw[n]) for n, p in paths.items()})
        return dict(paths)

    def _fetch_stored(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo) -> bytes:
        """The stored bytes of one chunk, checked against the manifest, or SnapshotCorrupt
        saying exactly what is wrong."""
        try:
            stored = self.store.get_bytes(c.key)
        except ObjectMissing as e:
            raise self._corrupt(stream, c, "is missing from the store") from e
        if len(stored) != c.stored_size:
            raise self._corrupt(stream, c, f"has {len(stored)} bytes, expected {c.stored_size}")
        if fmt.sha256_hex(stored) != c.sha256:
            raise self._corrupt(stream, c, "fails its sha256 check")
        return stored

    def _fetch_content(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo) -> bytes:
        """The raw bytes of one shared chunk, decoded and checked against its key. A bad copy
        in the node's chunk cache is dropped and fetched again from the store."""
        if self._locked is not None:
            raise self._locked
        for attempt in (0, 1):
            try:
                stored = self.store.get_bytes(c.key)
            except ObjectMissing as e:
                raise self._corrupt(stream, c, "is missing from the store") from e
            try:
                if self._opener is not None:
                    stored = self._opener.open(c.key, stored)
                raw = self._codec.decode(stored, c.raw_size)
                why = "" if len(raw) == c.raw_size else f"decodes to {len(raw)} bytes"
            except (CodecError, SealError) as e:
                why = str(e)
            if not why and self._content_digest(raw) == c.raw_sha256:
                return raw
            why = why or "fails its sha256 check"
            evict = getattr(self.store, "evict", None)
            if attempt or evict is None or not evict(c.key):
                break
        raise self._corrupt(stream, c, why + self._shared_by(c.key))

    def _content_digest(self, raw: bytes) -> str:
        sha = fmt.sha256_hex(raw)
        return sha if self._opener is None else self._opener.digest(sha)

    def _shared_by(self, key: str) -> str:
        """The other snapshots a damaged shared chunk breaks, for the error message."""
        try:
            others = [s for s in snapshots_using(self.store, key) if s != self.snapshot_id]
        except StorageUnavailable:
            return ""
        if not others:
            return ""
        more = f" and {len(others) - 10} more" if len(others) > 10 else ""
        shown = ", ".join(others[:10]) + more
        return f" (a shared chunk: snapshot(s) {shown} use it too and cannot be restored either)"

    def _decompress(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo, stored: bytes) -> bytes:
        """The raw bytes of one chunk, checked against the manifest."""
        try:
            raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=c.raw_size)
        except zstandard.ZstdError as e:
            raise self._corrupt(stream, c, f"does not decompress: {e}") from e
        if len(raw) != c.raw_size or fmt.sha256_hex(raw) != c.raw_sha256:
            raise self._corrupt(stream, c, "decompresses to the wrong bytes")
        return raw

    def _corrupt(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo, what: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(
            f"snapshot {self.snapshot_id!r} in {self.store.describe()}: stream {stream.name!r} "
            f"chunk {c.index} ({c.key}) {what}; nothing was restored",
            _CORRUPT_NEXT_STEP,
        )

    # -- phase two: extract ---------------------------------------------------------------

    def extract_directory(
        self, name: str, dest_path: str | os.PathLike[str], *, keep_stream: bool = False
    ) -> Path:
        """Untar verified directory stream `name` into `dest_path` (absent or an empty
        directory). Extraction goes to a sibling temp directory renamed into place once the
        whole stream verified, so a failure leaves nothing at `dest_path`. The staged file is
        removed afterwards unless `keep_stream`."""
        staged = self._staged_for(name)
        dest = self._check_dest(name, dest_path)
        return self._extract(name, staged, dest, keep_stream, None)

    def extract_directories(
        self, dests: Mapping[str, str | os.PathLike[str]], *, keep_stream: bool = False
    ) -> dict[str, Path]:
        """`extract_directory` for each {stream: dest_path}, up to `workers` streams at once.
        All or nothing: if one stream fails, the others stop and every destination already
        extracted is removed before the first failure is raised."""
        jobs = [(n, self._staged_for(n), self._check_dest(n, d)) for n, d in dests.items()]
        if not jobs:
            return {}
        cancel = threading.Event()
        with ThreadPoolExecutor(
            min(len(jobs), self.workers), thread_name_prefix=f"extract-{self.snapshot_id}"
        ) as pool:
            futures = {
                pool.submit(self._extract, n, staged, dest, keep_stream, cancel): dest
                for n, staged, dest in jobs
            }
            wait_futures(futures, return_when=FIRST_EXCEPTION)
            cancel.set()  # a no-op when all succeeded; otherwise stops the rest early
        _all_or_nothing(futures)
        return {n: dest for n, _, dest in jobs}

    def fetch_and_extract(
        self,
        dests: Mapping[str, str | os.PathLike[str]],
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Path]:
        """Fetch and unpack each {stream: dest_path}, streams side by side, with no staged copy:
        each stream's chunks are fetched in order, up to `2 * workers` ahead, and each is
        checked (sha256 of its raw bytes) before the archive reader sees any of its bytes. A
        stream is unpacked into a temp directory renamed into place only once all of it
        verified. All or nothing, as `extract_directories`: on any failure every destination
        already extracted is removed.

        `progress(raw_bytes)` is called once per chunk as it is handed to the unpacking, from
        several threads at once (the caller counts under a lock); over a fetch that succeeds
        its calls add up to the streams' `raw_size`. What it raises fails the fetch."""
        manifest = self.manifest()
        unknown = [n for n in dests if n not in manifest.streams]
        if unknown:
            raise InvalidArgument(
                f"snapshot {self.snapshot_id!r} has no stream(s) {unknown}",
                f"its streams are {sorted(manifest.streams)}",
            )
        jobs = [(n, self._check_dest(n, d)) for n, d in dests.items()]
        if not jobs:
            return {}
        cancel = threading.Event()
        fetchers = ThreadPoolExecutor(
            2 * self.workers, thread_name_prefix=f"get-{self.snapshot_id}"
        )

        def one(name: str, dest: Path) -> Path:
            if cancel.is_set():
                raise _Cancelled()
            src = _FetchedChunks(
                self, manifest.streams[name], fetchers, 2 * self.workers, cancel, progress
            )
            self._untar(name, src, dest)
            return dest

        try:
            with ThreadPoolExecutor(
                min(len(jobs), self.workers), thread_name_prefix=f"fetch-{self.snapshot_id}"
            ) as pool:
                futures = {pool.submit(one, n, dest): dest for n, dest in jobs}
                wait_futures(futures, return_when=FIRST_EXCEPTION)
                cancel.set()  # a no-op when all succeeded; otherwise stops the rest early
        finally:
            fetchers.shutdown(wait=True, cancel_futures=True)
        _all_or_nothing(futures)
        return {n: dest for n, dest in jobs}

    def _fetch_raw(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo) -> bytes:
        """One chunk's raw bytes from the store, checked, whatever its format."""
        if c.content_addressed:
            return self._fetch_content(stream, c)
        return self._decompress(stream, c, self._fetch_stored(stream, c))

    def _staged_for(self, name: str) -> _Staged:
        with self._lock:
            staged = self._staged.get(name)
        if staged is None or not staged.path.exists():
            raise InvalidArgument(
                f"stream {name!r} of snapshot {self.snapshot_id!r} has not been verified",
                "call verify_and_fetch for it before extracting",
            )
        return staged

    def _check_dest(self, name: str, dest_path: str | os.PathLike[str]) -> Path:
        dest = Path(dest_path)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidArgument(
                f"cannot extract snapshot stream {name!r} into {dest}: it exists and is not an "
                "empty directory",
                "extract into a fresh path",
            )
        return dest

    def _extract(
        self,
        name: str,
        staged: _Staged,
        dest: Path,
        keep_stream: bool,
        cancel: threading.Event | None,
    ) -> Path:
        if staged.compressed:
            stream = self.manifest().streams[name]
            src: io.RawIOBase = _VerifiedChunks(self, stream, staged.path, cancel)
        else:
            src = io.FileIO(staged.path, "r")
        self._untar(name, src, dest)
        if not keep_stream:
            staged.path.unlink(missing_ok=True)
            with self._lock:
                if self._staged.get(name) == staged:
                    del self._staged[name]
        return dest

    def _untar(self, name: str, src: io.RawIOBase, dest: Path) -> None:
        """Unpack stream `name`, read from `src`, into a temp directory beside `dest`, renamed
        to `dest` once every byte (the archive's end padding too) verified."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extracting-", dir=dest.parent))
        try:
            with src:
                bufsize = dirstream.TAR_READ_BUFSIZE
                with tarfile.open(fileobj=src, mode="r|", bufsize=bufsize) as tar:
                    tar.extractall(tmp, members=self._checked(name, tar), filter="data")
                drain = getattr(src, "drain", None)
                if drain is not None:
                    drain()  # the archive's end padding must verify too
            os.replace(tmp, dest)
        except tarfile.TarError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotCorrupt(
                f"snapshot {self.snapshot_id!r}: stream {name!r} is not a valid directory "
                f"archive: {e}",
                _CORRUPT_NEXT_STEP,
            ) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _checked(self, stream: str, tar: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
        # Each member is checked before it is extracted; one refused member fails the whole
        # extraction, whose temp directory is then removed.
        for m in tar:
            self._check_member(stream, m)
            yield m

    def _check_member(self, stream: str, m: tarfile.TarInfo) -> None:
        why = dirstream.unsafe_member(m)
        if why:
            raise SnapshotCorrupt(
                f"snapshot {self.snapshot_id!r}: stream {stream!r} holds {why}; nothing was "
                "extracted",
                _CORRUPT_NEXT_STEP,
            )


class _ChunkSource(io.RawIOBase):
    """A stream's raw bytes, one checked chunk at a time: `_load` puts the next chunk in
    `_raw` (False at the end), after checking it; reads hand out only loaded bytes."""

    _raw: memoryview

    def _load(self) -> bool:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        if not self._raw and not self._load():
            return b""
        n = min(size, len(self._raw))
        out = self._raw[:n].tobytes()  # the one copy: tarfile wants bytes
        self._raw = self._raw[n:]
        return out

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        if not self._raw and not self._load():
            return 0
        n = min(len(b), len(self._raw))
        b[:n] = self._raw[:n]
        self._raw = self._raw[n:]
        return n

    def drain(self) -> None:
        """Verify every chunk not read yet."""
        while self._load():
            pass


class _VerifiedChunks(_ChunkSource):
    """The raw bytes of one stream, read from its staged compressed chunks. Each chunk is
    decompressed and its raw size and sha256 checked before any of its bytes are handed out.

    A helper thread decompresses and checks the next chunk while the caller consumes this one
    (zstd and sha256 release the GIL), so at most `_CHUNKS_AHEAD + 2` raw chunks are held.
    """

    def __init__(
        self,
        reader: SnapshotReader,
        stream: fmt.StreamInfo,
        path: Path,
        cancel: threading.Event | None,
    ) -> None:
        super().__init__()
        self._file = open(path, "rb", buffering=0)  # closed in close()
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(_CHUNKS_AHEAD)
        self._stop = threading.Event()
        self._raw = memoryview(b"")
        self._eof = False
        self._thread = threading.Thread(
            target=self._produce,
            args=(reader, stream, cancel),
            name=f"extract-{reader.snapshot_id}-{stream.name}",
            daemon=True,
        )
        self._thread.start()


    def _load(self) -> bool:
        if self._eof:
            return False
        item = self._queue.get()
        if item is None or isinstance(item, BaseException):
            self._eof = True
            if item is not None:
                raise item
            return False
        self._raw = memoryview(item)
        return True

    def _produce(
        self, reader: SnapshotReader, stream: fmt.StreamInfo, cancel: threading.Event | None
    ) -> None:
        try:
            for c in stream.chunks:
                if cancel is not None and cancel.is_set():
                    raise _Cancelled()
                stored = self._file.read(c.stored_size)
                if len(stored) != c.stored_size:
                    raise reader._corrupt(
                        stream, c, f"is truncated in the staged copy {self._file.name}"
                    )
                if not self._put(reader._decompress(stream, c, stored)):
                    return
            self._put(None)
        except BaseException as e:  # noqa: BLE001 - raised in the reading thread
            self._put(e)

    def _put(self, item: bytes | BaseException | None) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def close(self) -> None:
        if not self.closed:
            self._stop.set()
            self._thread.join()
            self._raw = memoryview(b"")
            self._file.close()
        super().close()


class _FetchedChunks(_ChunkSource):
    """The raw bytes of one stream, fetched from the store chunk by chunk in order, `ahead`
    chunks in flight on `pool`; each chunk is checked before any of its bytes are handed out."""

    def __init__(
        self,
        reader: SnapshotReader,
        stream: fmt.StreamInfo,
        pool: ThreadPoolExecutor,
        ahead: int,
        cancel: threading.Event,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()
        self._reader, self._stream, self._pool = reader, stream, pool
        self._ahead, self._cancel, self._progress = ahead, cancel, progress
        self._pending: deque[Future[bytes]] = deque()
        self._next = 0
        self._raw = memoryview(b"")
        self._fill()

    def _fill(self) -> None:
        chunks = self._stream.chunks
        while len(self._pending) < self._ahead and self._next < len(chunks):
            c = chunks[self._next]
            self._pending.append(self._pool.submit(self._reader._fetch_raw, self._stream, c))
            self._next += 1

    def _load(self) -> bool:
        if self._cancel.is_set():
            raise _Cancelled()
        if not self._pending:
            return False
        raw = self._pending.popleft().result()
        self._fill()
        self._raw = memoryview(raw)
        if self._progress is not None:
            self._progress(len(raw))
        return True

    def close(self) -> None:
        if not self.closed:
            for f in self._pending:
                f.cancel()
            for f in self._pending:
                if not f.cancelled():
                    f.exception()  # wait: no fetch outlives its stream
            self._pending.clear()
            self._raw = memoryview(b"")
        super().close()


_CORRUPT_NEXT_STEP = (
    "this snapshot cannot be restored; thaw from an earlier one (`snapshotter list`) and "
    "delete this one"
)


def _all_or_nothing(futures: Mapping[Future[Path], Path]) -> None:
    """Raise the first real failure of a set of extractions, after removing every destination
    that was extracted (the others were cancelled, or failed and cleaned up after themselves)."""
    failures = [
        e for f in futures if (e := f.exception()) is not None and not isinstance(e, _Cancelled)
    ]
    if failures:
        for f, dest in futures.items():
            if f.exception() is None:
                shutil.rmtree(dest, ignore_errors=True)
        raise failures[0]


def _content(stream: fmt.StreamInfo) -> bool:
    return any(c.content_addressed for c in stream.chunks)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _unlink_all(paths: Iterable[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
