"""A directory as a snapshot stream: the one way its tar bytes are made, and the check that a
local directory is byte for byte a committed stream.

The writer streams a rank's image directory through `tar_directory`; the agent keeps that
directory after the commit (its local copy) and, before a thaw restores from it, `matches`
makes the same bytes again and compares every chunk's length and raw sha256 with the
manifest: a copy that changed in any byte, lost or gained a file, or was touched in its
metadata is refused, and the thaw fetches from the store instead.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, cast

import xxhash

from snapshotter.storage import format as fmt

# tarfile's stream reader joins and re-slices its buffer on every read, and copies file data
# out in 16 KiB reads: a 32 KiB buffer keeps both cheap (its 10 KiB default costs a Python
# call per 10 KiB; larger buffers are copied over and over).
TAR_READ_BUFSIZE = 32 * 1024
COPY_BUFSIZE = 1024 * 1024  # file data in 1 MiB writes: one chunker call per MiB


def unsafe_member(m: tarfile.TarInfo) -> str:
    """Why archive member `m` must not be extracted from a stream ("" when it may): CRIU
    image directories hold only files and directories, under relative paths."""
    p = PurePosixPath(m.name)
    if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()):
        return f"unsafe archive member {m.name!r} (type {m.type!r})"
    return ""


class Sink(Protocol):
    def write(self, data: bytes, /) -> int: ...


class _Counted:
    """A write-only file that counts what passes (tarfile wants `tell`)."""

    def __init__(self, out: Sink) -> None:
        self.out = out
        self.pos = 0

    def write(self, data: bytes) -> int:
        self.out.write(data)
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class _Marked(io.RawIOBase):
    """A member's file that calls `on_start(size)` on its first read: tarfile has written the
    member's header by then, so the archive's next byte is the file's first."""

    def __init__(self, f: BinaryIO, size: int, on_start: Callable[[int], None]) -> None:
        super().__init__()
        self.f, self.size, self.on_start, self.started = f, size, on_start, False

    def read(self, n: int = -1) -> bytes:
        if not self.started:
            self.started = True
            self.on_start(self.size)
        return self.f.read(n)


def tar_directory(root: Path, out: Sink, on_file: Callable[[int], None] | None = None) -> None:
    """Write the tree under `root` to `out` as an uncompressed PAX tar, entries in sorted order
    with paths relative to `root` (the bytes `tar.add` makes): the same tree gives the same
    bytes. `on_file(size)` is called right before each regular file's data is written."""
    with tarfile.open(
        fileobj=cast(BinaryIO, _Counted(out)), mode="w", format=tarfile.PAX_FORMAT
    ) as tar:
        tar.copybufsize = COPY_BUFSIZE  # type: ignore[attr-defined]  # in CPython, not typeshed
        for info, path in _members(tar, root):
            if info.isreg():
                with open(path, "rb") as f:
                    src: BinaryIO = f
                    if on_file is not None:
                        src = cast(BinaryIO, _Marked(f, info.size, on_file))
                    tar.addfile(info, src)
            else:
                tar.addfile(info)


def tar_size(root: Path) -> int:
    """The number of bytes `tar_directory(root, ...)` writes, from the tree's metadata alone
    (no file is read): what an upload's progress counts up to. Headers as `addfile` makes
    them, file data padded to blocks, the end blocks padded to a record: exact while the tree
    does not change."""
    size = 0
    with tarfile.open(fileobj=io.BytesIO(), mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, _ in _members(tar, root):
            size += len(info.tobuf(tar.format, tar.encoding, tar.errors))
            if info.isreg():
                size += -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
    size += 2 * tarfile.BLOCKSIZE
    return -(-size // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _members(tar: tarfile.TarFile, root: Path) -> Iterator[tuple[tarfile.TarInfo, Path]]:
    """The entries under `root` in archive order (sorted, each directory before what it
    holds), as `tar` describes them: it notes hard links as it goes, so one `tar` per walk."""

    def walk(path: Path, arcname: str) -> Iterator[tuple[tarfile.TarInfo, Path]]:
        info = tar.gettarinfo(path, arcname)
        yield info, path
        if info.isdir():
            for entry in sorted(os.listdir(path)):
                yield from walk(path / entry, f"{arcname}/{entry}")

    for entry in sorted(os.listdir(root)):
        yield from walk(root / entry, entry)


class _ChunkHasher:
    """A write-only file that hashes what it is given in the stream's chunk boundaries and
    stops at the first chunk that differs."""

    def __init__(self, stream: fmt.StreamInfo, keyed: Callable[[str], str] | None) -> None:
        self.stream = stream
        self.keyed = keyed
        self.index = 0
        self.filled = 0
        self.hash = self._new_hash()
        self.mismatch = ""

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        while view and not self.mismatch:
            if self.index >= len(self.stream.chunks):
                self.mismatch = f"longer than its {self.stream.raw_size} bytes"
                break
            want = self.stream.chunks[self.index].raw_size
            take = min(want - self.filled, len(view))
            self.hash.update(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == want:
                self._close_chunk()
        return len(data)

    def _close_chunk(self) -> None:
        c = self.stream.chunks[self.index]
        got = self.hash.hexdigest()
        if c.xxh3 and self.keyed is not None:
            got = self.keyed(got)
        if got != (c.xxh3 or c.raw_sha256):
            self.mismatch = f"chunk {c.index} differs"
        self.index += 1
        self.filled = 0
        self.hash = self._new_hash()

    def _new_hash(self) -> Any:
        # The node's own copy of what it wrote, checked against accidental change (a disk,
        # a stray write): xxh3-128, ten times sha256's speed, where the manifest has it. A
        # copy someone altered on purpose would take root on this node, who could alter
        # anything.
        if self.index < len(self.stream.chunks) and self.stream.chunks[self.index].xxh3:
            return xxhash.xxh3_128()
        return hashlib.sha256()

    def flush(self) -> None:
        pass

    def result(self) -> str:
        """Empty when every chunk matched and nothing was left over, else what differed."""
        if self.mismatch:
            return self.mismatch
        if self.filled or self.index != len(self.stream.chunks):
            return f"shorter than its {self.stream.raw_size} bytes"
        return ""


def matches(stream: fmt.StreamInfo, root: Path, keyed: Callable[[str], str] | None = None) -> str:
    """Whether directory `root` is stream `stream` of a committed manifest: "" when it is,
    else why not. `keyed`: a sealed manifest's xxh3 of plain xxh3 (sealing.Seal.fast)."""
    if not root.is_dir():
        return f"{root} is missing"
    sink = _ChunkHasher(stream, keyed)
    try:
        tar_directory(root, sink)
    except OSError as e:
        return f"unreadable: {e}"
    return sink.result()
