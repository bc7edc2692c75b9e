"""A migrating rank's images, straight from the agent that dumped them to the one that
restores them: no object store in between.

    source  OfferImages(ticket)  the dumped freeze may be read by whoever holds the ticket
            ReadImages(stream)   one rank's image directory as entries (a directory, or a
                                 file followed by its data in pieces), then an end piece
                                 with the sha256 over every entry and byte, and the length
    target  Receive              one ReadImages per rank in parallel, each written as it
                                 arrives into a temp directory that is renamed into place only
                                 when the sha256 and length match: nothing is restored from an
                                 incomplete or altered transfer (a failed one leaves nothing)

Files are read and written in whole pieces (no tar: every copy of the bytes in Python costs
on the transfer, which is the migration's downtime). The bytes travel over the agents' own
gRPC channels: mutual TLS where the agents have certificates (the target calls with its
node certificate; TRANSFER is a node's right), and the ticket binds a read to one migration
the coordinator started.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath

from snapshotter import errors
from snapshotter.v1 import agent_pb2

PIECE_BYTES = 4 << 20
_NEXT_STEP = "the ranks stay where they were; retry the migration"


def check_ticket(offered: str, presented: str, node: str) -> None:
    """Raises: PermissionDenied unless `presented` is the ticket this freeze was offered with."""
    if not offered or not hmac.compare_digest(offered.encode(), presented.encode()):
        raise errors.PermissionDenied(
            f"node {node} offers no images for that ticket",
            "only the target the coordinator named in a migration may read them",
            right="TRANSFER",
        )


def check_room(where: Path, size: int, node: str, spare: float = 0.1) -> None:
    """Raises: MigrationFailed unless the filesystem of `where` has `size` bytes free and a
    tenth more (a full disk would fail the transfer half-way, after the job stalled for it)."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    need = int(size * (1 + spare))
    if free < need:
        raise errors.MigrationFailed(
            f"node {node} has {free / 2**30:.1f} GiB free in {where}, and the ranks' images "
            f"need {need / 2**30:.1f} GiB",
            "free disk there or migrate to another node; the job trains on where it was",
        )


def _entry_key(path: str, dir_: bool, size: int) -> bytes:
    return f"{path}\0{'d' if dir_ else size}\0".encode()


def _entries(root: Path) -> Iterator[tuple[str, Path, bool]]:
    """(relative path, path, is a directory) under `root`, parents first, sorted."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(dirnames):
            yield str((base / name).relative_to(root)), base / name, True
        for name in sorted(filenames):
            yield str((base / name).relative_to(root)), base / name, False


def pieces(root: Path) -> Iterator[agent_pb2.ImagePiece]:
    """`root`'s directories and files as pieces; the last one carries the sha256 and length.

    Raises: MigrationFailed if `root` holds something other than files and directories."""
    digest = hashlib.sha256()
    total = 0
    buf = bytearray(PIECE_BYTES)
    for rel, path, is_dir in _entries(root):
        st = path.lstat()
        if is_dir:
            digest.update(_entry_key(rel, True, 0))
            yield agent_pb2.ImagePiece(path=rel, dir=True)
            continue
        if not stat.S_ISREG(st.st_mode):
            raise errors.MigrationFailed(
                f"rank images hold {rel!r}, neither a file nor a directory", _NEXT_STEP
            )
        digest.update(_entry_key(rel, False, st.st_size))
        yield agent_pb2.ImagePiece(path=rel, file_size=st.st_size)
        left = st.st_size
        with open(path, "rb", buffering=0) as f:
            while left:
                n = f.readinto(memoryview(buf)[: min(left, PIECE_BYTES)])
                if not n:
                    raise errors.MigrationFailed(
                        f"rank image {rel!r} shrank while it was sent", _NEXT_STEP
                    )
                data = bytes(memoryview(buf)[:n])
                digest.update(data)
                left -= n
                total += n
                yield agent_pb2.ImagePiece(data=data)
    yield agent_pb2.ImagePiece(sha256=digest.hexdigest(), size=total, last=True)


def _safe(rel: str, stream: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "." in p.parts:
        raise errors.MigrationFailed(
            f"rank images {stream!r} hold unsafe path {rel!r}; nothing was restored", _NEXT_STEP
        )
    return rel


def receive(
    stream: Iterable[agent_pb2.ImagePiece], dest: Path, on_bytes: Callable[[int], None]
) -> int:
    """Write one rank's image stream into `dest` (absent). Returns the data bytes received.

    Raises: MigrationFailed if it is incomplete, altered or names an unsafe path (then
    nothing is left at `dest`)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.receiving-", dir=dest.parent))
    digest = hashlib.sha256()
    total = 0
    fd = -1
    left = 0
    rel = ""
    try:
        for p in stream:
            if p.last:
                if left or p.size != total or p.sha256 != digest.hexdigest():
                    break
                os.replace(tmp, dest)
                return total
            if p.path:
                if left:
                    break  # a new entry before the previous file's data ended
                if fd >= 0:
                    os.close(fd)
                    fd = -1
                rel = _safe(p.path, dest.name)
                digest.update(_entry_key(rel, p.dir, p.file_size))
                if p.dir:
                    (tmp / rel).mkdir()
                else:
                    fd = os.open(tmp / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    left = p.file_size
                continue
            if fd < 0 or len(p.data) > left:
                break  # data outside a file, or more than it holds
            digest.update(p.data)
            view = memoryview(p.data)
            while view:
                view = view[os.write(fd, view):]
            left -= len(p.data)
            total += len(p.data)
            on_bytes(len(p.data))
        raise errors.MigrationFailed(
            f"rank images {dest.name!r} arrived altered or incomplete ({total} bytes, at "
            f"{rel or 'the start'})",
            _NEXT_STEP,
        )
    except OSError as e:
        raise errors.MigrationFailed(
            f"could not write rank images {dest.name!r} at {rel!r}: {e}",
            f"check the disk of this node's SNAPSHOTTER_HOME; {_NEXT_STEP}",
        ) from e
    finally:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
