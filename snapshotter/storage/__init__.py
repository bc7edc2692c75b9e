"""Snapshot storage: where frozen jobs' CRIU images go, and how they come back intact.

api          ObjectStore, the backend boundary (put/get/head/list/delete)
local        LocalDirStore, the embedded default (a directory)
s3           S3Store, any S3-compatible object store via boto3
url          open_store("file:///path" | "s3://bucket/prefix")
format       key layout and manifest (the on-store grammar)
tasks        TransferTasks, tasks/status/first failure/cleanups of one transfer
writer       SnapshotWriter: chunk, compress, hash, upload, commit manifest last
reader       SnapshotReader: verify every chunk, then extract
catalog      list_snapshots, delete_snapshot, find_orphans
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from snapshotter.storage.api import ObjectInfo, ObjectMissing, ObjectStore
    from snapshotter.storage.catalog import delete_snapshot, find_orphans, list_snapshots
    from snapshotter.storage.format import ChunkInfo, Manifest, StreamInfo
    from snapshotter.storage.local import LocalDirStore
    from snapshotter.storage.reader import SnapshotReader
    from snapshotter.storage.s3 import S3Store, S3Tuning
    from snapshotter.storage.url import open_store
    from snapshotter.storage.writer import DEFAULT_CHUNK_SIZE, Progress, SnapshotWriter

# Where each name of the package lives. Loaded when first used, not with the package: the CLI
# imports storage.format and storage.signing on every call, and boto3 and numpy (s3, writer)
# cost it most of a second of CPU each time (tests poll the CLI; so do operators' scripts).
_HOME = {
    "ObjectInfo": "api", "ObjectMissing": "api", "ObjectStore": "api",
    "delete_snapshot": "catalog", "find_orphans": "catalog", "list_snapshots": "catalog",
    "ChunkInfo": "format", "Manifest": "format", "StreamInfo": "format",
    "LocalDirStore": "local", "SnapshotReader": "reader", "S3Store": "s3", "S3Tuning": "s3",
    "open_store": "url", "DEFAULT_CHUNK_SIZE": "writer", "Progress": "writer",
    "SnapshotWriter": "writer",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next use is a plain attribute, as an import made it
    return value


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "ChunkInfo",
    "LocalDirStore",
    "Manifest",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectStore",
    "Progress",
    "S3Store",
    "S3Tuning",
    "SnapshotReader",
    "SnapshotWriter",
    "StreamInfo",
    "delete_snapshot",
    "find_orphans",
    "list_snapshots",
    "open_store",
]
