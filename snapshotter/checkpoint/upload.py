"""Carry out a checkpoint request: store one rank's part, or commit the checkpoint.

Run by the node agent (agent/checkpoints.py) for its ranks, or as a child process of a rank
that has no agent (`python -m snapshotter.checkpoint.upload`, request on stdin, memfds
inherited, result on stdout). Either way the bytes go through the snapshot writer: chunked
on page boundaries, deduplicated against the rank's previous part and everything else in the
checkpoint namespace, compressed by measurement, uploaded on worker threads with a bounded
number of chunks in flight (so memory stays a few chunks whatever the state's size).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from snapshotter.checkpoint import catalog
from snapshotter.checkpoint.spool import (
    WEIGHT_OPS,
    Request,
    failed,
    ok,
    parse_request,
    read_extent,
)
from snapshotter.errors import InvalidArgument, SnapshotterError
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectMissing, ObjectStore
from snapshotter.storage.sealing import Seal
from snapshotter.storage.writer import SnapshotWriter

log = logging.getLogger(__name__)
_PIECE = 4 * 1024 * 1024

# fd number in the request -> an fd this process may pread (and the caller closes).
FdOpener = Callable[[int], int]


class _Extents:
    """The extents of a request as one readable stream, each starting on a page (the layout
    the rank recorded for DCP: catalog.layout)."""

    def __init__(self, request: Request, fds: Mapping[int, int]) -> None:
        self._pieces = self._generate(request, fds)
        self._piece = memoryview(b"")
        self.raw = 0

    def _generate(self, request: Request, fds: Mapping[int, int]) -> Iterator[bytes]:
        offsets = catalog.layout([e.length for e in request.extents])
        at = 0
        for e, start in zip(request.extents, offsets, strict=True):
            if start > at:
                yield bytes(start - at)
            for o in range(0, e.length, _PIECE):
                n = min(_PIECE, e.length - o)
                yield read_extent(fds[e.fd], e.offset + o, n)
            at = start + e.length

    def read(self, size: int = -1) -> bytes:
        # A piece is consumed through a view: what is left of it is never copied again.
        out = bytearray()
        while size < 0 or len(out) < size:
            if not self._piece:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                self._piece = memoryview(piece)
            n = len(self._piece) if size < 0 else min(len(self._piece), size - len(out))
            out += self._piece[:n]
            self._piece = self._piece[n:]
        self.raw += len(out)
        return bytes(out)


def handle(
    store: ObjectStore, request: Request, open_fd: FdOpener, seal: Seal | None = None
) -> dict[str, Any]:
    """Carry out `request` against the checkpoint namespace `store`, every chunk sealed
    under `seal` when given (the job's tenant data key); return its result (spool.ok /
    spool.failed), never raise for the request's own faults."""
    started = time.monotonic()
    fds: dict[int, int] = {}
    try:
        if request.op in WEIGHT_OPS:
            raise InvalidArgument(
                "weights move only between snapshotter node agents, and this rank has none",
                "run the job with `snapshotter run` (or thaw it under snapshotter)",
            )
        catalog.check_name(request.name)
        for fd in request.fds:
            fds[fd] = open_fd(fd)
        if request.op == "part":
            w = _part(store, request, fds, seal)
        else:
            w = _commit(store, request, fds, seal)
        m = w.committed
        assert m is not None
        return ok(m.raw_size, m.stored_size, w.uploaded_bytes, time.monotonic() - started)
    except SnapshotterError as e:
        log.warning("checkpoint %s (%s) failed: %s", request.name, request.op, e.cause)
        return failed(e)
    except Exception as e:  # noqa: BLE001 - the rank must hear back whatever went wrong
        log.exception("checkpoint %s (%s) failed", request.name, request.op)
        return failed(e)
    finally:
        for fd in fds.values():
            os.close(fd)


def _seed(store: ObjectStore, part: str) -> list[fmt.StreamInfo]:
    if not part:
        return []
    try:
        fmt.validate_name(part)
        return list(fmt.Manifest.from_json(store.get_bytes(fmt.manifest_key(part))).streams
                    .values())  # fmt: skip
    except (ValueError, ObjectMissing, fmt.ManifestError):
        return []  # dedup still finds stored content by its key, one request per chunk


def _part(
    store: ObjectStore, request: Request, fds: Mapping[int, int], seal: Seal | None
) -> SnapshotWriter:
    pid = catalog.part_id(request.name, request.index)
    with SnapshotWriter(store, pid, seed=_seed(store, request.seed), seal=seal) as w:
        w.write_stream(catalog.DATA_STREAM, _Extents(request, fds))
        w.commit({"kind": catalog.PART_KIND, "checkpoint": request.name, "index": request.index})
    return w


def _commit(
    store: ObjectStore, request: Request, fds: Mapping[int, int], seal: Seal | None
) -> SnapshotWriter:
    expected = {catalog.part_id(request.name, i) for i in range(len(request.parts))}
    if set(request.parts) != expected:
        raise InvalidArgument(
            f"checkpoint {request.name!r} names parts {sorted(request.parts)[:3]}..., not its own",
            "save again; parts are named by the checkpoint and the rank's index",
        )
    raw = stored = 0
    for part in request.parts:
        try:
            m = fmt.Manifest.from_json(store.get_bytes(fmt.manifest_key(part)))
        except ObjectMissing:
            raise InvalidArgument(
                f"part {part} of checkpoint {request.name!r} was never committed",
                "a rank's upload failed or was killed: see its error, then save again",
            ) from None
        raw += m.raw_size
        stored += m.stored_size
    meta = {**dict(request.meta or {}), "kind": catalog.KIND, "parts": list(request.parts),
            "raw_bytes": raw, "stored_bytes": stored}  # fmt: skip
    with SnapshotWriter(store, request.name, seal=seal) as w:
        w.write_stream(catalog.METADATA_STREAM, _Extents(request, fds))
        w.commit(meta)
    return w


def main() -> int:
    """A rank's child: one request on stdin, the memfds it names inherited."""
    from snapshotter.storage.url import open_store

    try:
        request = parse_request(sys.stdin.buffer.read())
        store = catalog.checkpoint_store(open_store(request.url))
    except SnapshotterError as e:
        sys.stdout.write(json.dumps(failed(e)))
        return 0
    result = handle(store, request, os.dup)
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
