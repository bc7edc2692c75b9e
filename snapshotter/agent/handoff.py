"""A migrating rank's images, straight from the agent that dumped them to the one that
restores them: no object store in between.

    source  OfferImages(ticket)  the dumped freeze may be read by whoever holds the ticket
            ReadImages(stream)   one rank's image directory as a tar (storage/dirstream.py),
                                 in pieces; the last carries the sha256 and length of it all
    target  Receive              one ReadImages per rank in parallel, each untarred as it
                                 arrives into a temp directory that is renamed into place only
                                 when the sha256 and length match: nothing is restored from an
                                 incomplete or altered transfer (a failed one leaves nothing)

The bytes travel over the agents' own gRPC channels: mutual TLS where the agents have
certificates (the target calls with its node certificate; TRANSFER is a node's right), and
the ticket binds a read to one migration the coordinator started.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import queue
import shutil
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from snapshotter import errors
from snapshotter.storage import dirstream
from snapshotter.v1 import agent_pb2

PIECE_BYTES = 1 << 20
_AHEAD = 8  # pieces the tar writer may run ahead of the gRPC stream (bounded memory)
_NEXT_STEP = "the ranks stay where they were; retry the migration"


def check_ticket(offered: str, presented: str, node: str) -> None:
    """Raises: PermissionDenied unless `presented` is the ticket this freeze was offered with."""
    if not offered or not hmac.compare_digest(offered.encode(), presented.encode()):
        raise errors.PermissionDenied(
            f"node {node} offers no images for that ticket",
            "only the target the coordinator named in a migration may read them",
            right="TRANSFER",
        )


class _Pieces(io.RawIOBase):
    """The write end of the tar: whole pieces to a bounded queue."""

    def __init__(self, out: queue.Queue[bytes | BaseException | None], stop: threading.Event):
        self._out = out
        self._stop = stop
        self._buf = bytearray()
        self.digest = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._buf += b
        self.digest.update(b)
        self.size += len(b)
        while len(self._buf) >= PIECE_BYTES:
            self._put(bytes(self._buf[:PIECE_BYTES]))
            del self._buf[:PIECE_BYTES]
        return len(b)

    def flush_rest(self) -> None:
        if self._buf:
            self._put(bytes(self._buf))
            self._buf.clear()

    def _put(self, piece: bytes) -> None:
        while not self._stop.is_set():
            try:
                self._out.put(piece, timeout=0.5)
                return
            except queue.Full:
                continue
        raise errors.MigrationFailed("the target stopped reading", _NEXT_STEP)


def pieces(root: Path) -> Iterator[agent_pb2.ImagePiece]:
    """`root` as tar pieces; the last one (possibly empty) carries the sha256 and length."""
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=_AHEAD)
    stop = threading.Event()
    out = _Pieces(q, stop)

    def write() -> None:
        try:
            dirstream.tar_directory(root, out)  # type: ignore[arg-type]
            out.flush_rest()
            q.put(None)
        except BaseException as e:  # noqa: BLE001 - handed to the reader below
            if not stop.is_set():
                q.put(e)

    threading.Thread(target=write, daemon=True, name=f"offer-{root.name}").start()
    try:
        while True:
            item = q.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            yield agent_pb2.ImagePiece(data=item)
        yield agent_pb2.ImagePiece(sha256=out.digest.hexdigest(), size=out.size, last=True)
    finally:
        stop.set()  # the target went away (or we are done): the writer thread ends


class _Incoming(io.RawIOBase):
    """The read end: the bytes of a piece stream, hashed as tarfile consumes them."""

    def __init__(self, stream: Iterable[agent_pb2.ImagePiece], on_bytes: Callable[[int], None]):
        self._it = iter(stream)
        self._view = memoryview(b"")
        self._on_bytes = on_bytes
        self.digest = hashlib.sha256()
        self.size = 0
        self.last: agent_pb2.ImagePiece | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._view:
            if self.last is not None:
                return 0
            p = next(self._it, None)
            if p is None:
                raise errors.MigrationFailed(
                    "the source's image stream ended early", _NEXT_STEP
                )
            if p.last:
                self.last = p
            if p.data:
                self.digest.update(p.data)
                self.size += len(p.data)
                self._on_bytes(len(p.data))
                self._view = memoryview(p.data)
        n = min(len(b), len(self._view))
        b[:n] = self._view[:n]
        self._view = self._view[n:]
        return n

    def drain(self) -> None:
        while self.readinto(bytearray(PIECE_BYTES)):
            pass


def receive(
    stream: Iterable[agent_pb2.ImagePiece], dest: Path, on_bytes: Callable[[int], None]
) -> int:
    """Untar one rank's image stream into `dest` (absent). Returns its length in bytes.

    Raises: MigrationFailed if it is incomplete, altered or holds an unsafe member (then
    nothing is left at `dest`)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.receiving-", dir=dest.parent))
    src = _Incoming(stream, on_bytes)
    try:
        with tarfile.open(fileobj=src, mode="r|", bufsize=dirstream.TAR_READ_BUFSIZE) as tar:
            tar.extractall(tmp, members=_checked(tar, dest.name), filter="data")
        src.drain()  # the archive's end padding counts too
        last = src.last
        if last is None or last.size != src.size or last.sha256 != src.digest.hexdigest():
            raise errors.MigrationFailed(
                f"rank images {dest.name!r} arrived altered or incomplete ({src.size} bytes)",
                _NEXT_STEP,
            )
        os.replace(tmp, dest)
        return src.size
    except tarfile.TarError as e:
        raise errors.MigrationFailed(
            f"rank images {dest.name!r} are not a valid directory archive: {e}", _NEXT_STEP
        ) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _checked(tar: tarfile.TarFile, stream: str) -> Iterator[tarfile.TarInfo]:
    for m in tar:
        why = dirstream.unsafe_member(m)
        if why:
            raise errors.MigrationFailed(
                f"rank images {stream!r} hold {why}; nothing was restored", _NEXT_STEP
            )
        yield m
