"""Reading a snapshot back: verify every chunk first, restore nothing until all are good.

    reader = SnapshotReader(store, "job1-0001")
    staged = reader.verify_and_fetch(staging_dir, streams=["rank-0"])
    reader.extract_directory("rank-0", "/var/lib/snapshotter/restore/rank-0")

`verify_and_fetch` downloads chunks in parallel, checks each one's sha256 against the manifest,
decompresses it and writes it at its offset into one staging file per stream. It returns only
once every chunk of every requested stream checked out; on the first bad chunk it stops, removes
the staging files and raises `SnapshotCorrupt` naming snapshot, stream, chunk and key. Only then
may a caller extract, and extraction refuses tar members that would land outside the target
(absolute paths, '..', links, devices). This module must never hand out or extract bytes that
were not verified.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

import zstandard

from snapshotter.errors import InvalidArgument, SnapshotCorrupt, SnapshotNotFound
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectMissing, ObjectStore
from snapshotter.storage.coordinator import TransferCoordinator

DEFAULT_WORKERS = 4
STAGED_SUFFIX = ".stream"

FetchProgressFn = Callable[[str, int, int], None]  # (stream, chunks verified, chunks in stream)


class SnapshotReader:
    """Reads one committed snapshot.

    Raises (from its methods):
        SnapshotNotFound: no committed snapshot with this id (no manifest).
        SnapshotCorrupt: the manifest or a chunk is damaged or missing.
        StorageUnavailable: the store failed.
        InvalidArgument: an unknown stream, or extraction before verification.
    """

    def __init__(
        self, store: ObjectStore, snapshot_id: str, *, workers: int = DEFAULT_WORKERS
    ) -> None:
        try:
            fmt.validate_name(snapshot_id)
        except ValueError as e:
            raise InvalidArgument(str(e), "run `snapshotter list` for valid ids") from e
        self.store = store
        self.snapshot_id = snapshot_id
        self.workers = workers
        self._manifest: fmt.Manifest | None = None
        self._staged: dict[str, Path] = {}

    def manifest(self) -> fmt.Manifest:
        if self._manifest is None:
            key = fmt.manifest_key(self.snapshot_id)
            try:
                data = self.store.get_bytes(key)
            except ObjectMissing as e:
                raise SnapshotNotFound(self.snapshot_id, self.store.describe()) from e
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
            self._manifest = m
        return self._manifest

    def verify_and_fetch(
        self,
        dest_dir: str | os.PathLike[str],
        streams: Iterable[str] | None = None,
        progress: FetchProgressFn | None = None,
    ) -> dict[str, Path]:
        """Download and verify every chunk of `streams` (default: all) into
        `<dest_dir>/<stream>.stream` files; return {stream: staged file}."""
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
        paths = {n: dest / f"{n}{STAGED_SUFFIX}" for n in names}
        fds: dict[str, int] = {}
        coord = TransferCoordinator(
            self.workers, 2 * self.workers, name=f"fetch-{self.snapshot_id}"
        )
        coord.add_cleanup(lambda: _unlink_all(paths.values()))
        counts = {n: 0 for n in names}

        def fetch(stream: fmt.StreamInfo, chunk: fmt.ChunkInfo) -> None:
            raw = self._fetch_chunk(stream, chunk)
            _pwrite_all(fds[stream.name], raw, stream.offset(chunk.index))
            if progress is not None:
                counts[stream.name] += 1  # benign race: display only
                progress(stream.name, counts[stream.name], len(stream.chunks))

        try:
            for n in names:
                fds[n] = os.open(paths[n], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.ftruncate(fds[n], manifest.streams[n].raw_size)
            for n in names:
                s = manifest.streams[n]
                for c in s.chunks:
                    coord.submit(fetch, s, c)
            coord.wait()
        except BaseException:
            coord.abort()  # waits for running fetches before their files are closed/removed
            _close_all(fds.values())
            raise
        _close_all(fds.values())
        coord.done()
        self._staged.update(paths)
        return dict(paths)

    def _fetch_chunk(self, stream: fmt.StreamInfo, c: fmt.ChunkInfo) -> bytes:
        """The raw bytes of one chunk, or SnapshotCorrupt saying exactly what is wrong."""
        try:
            stored = self.store.get_bytes(c.key)
        except ObjectMissing as e:
            raise self._corrupt(stream, c, "is missing from the store") from e
        if len(stored) != c.stored_size:
            raise self._corrupt(stream, c, f"has {len(stored)} bytes, expected {c.stored_size}")
        if fmt.sha256_hex(stored) != c.sha256:
            raise self._corrupt(stream, c, "fails its sha256 check")
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

    def extract_directory(
        self, name: str, dest_path: str | os.PathLike[str], *, keep_stream: bool = False
    ) -> Path:
        """Untar verified directory stream `name` into `dest_path` (absent or an empty
        directory). Extraction goes to a sibling temp directory renamed into place at the end,
        so a failure leaves nothing at `dest_path`. The staged stream file is removed afterwards
        unless `keep_stream`."""
        staged = self._staged.get(name)
        if staged is None or not staged.exists():
            raise InvalidArgument(
                f"stream {name!r} of snapshot {self.snapshot_id!r} has not been verified",
                "call verify_and_fetch for it before extracting",
            )
        dest = Path(dest_path)
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidArgument(
                f"cannot extract snapshot stream {name!r} into {dest}: it exists and is not an "
                "empty directory",
                "extract into a fresh path",
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.extracting-", dir=dest.parent))
        try:
            with tarfile.open(staged, mode="r:") as tar:
                members = tar.getmembers()
                for m in members:
                    self._check_member(name, m)
                tar.extractall(tmp, members=members, filter="data")
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
        if not keep_stream:
            staged.unlink(missing_ok=True)
            del self._staged[name]
        return dest

    def _check_member(self, stream: str, m: tarfile.TarInfo) -> None:
        p = PurePosixPath(m.name)
        bad = (
            p.is_absolute()
            or ".." in p.parts
            or not (m.isfile() or m.isdir())  # CRIU image dirs hold only files and dirs
        )
        if bad:
            raise SnapshotCorrupt(
                f"snapshot {self.snapshot_id!r}: stream {stream!r} holds unsafe archive member "
                f"{m.name!r} (type {m.type!r}); nothing was extracted",
                _CORRUPT_NEXT_STEP,
            )


_CORRUPT_NEXT_STEP = (
    "this snapshot cannot be restored; thaw from an earlier one (`snapshotter list`) and "
    "delete this one"
)


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
