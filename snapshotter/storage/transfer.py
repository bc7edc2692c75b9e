"""The snapshot data path in one import: write (`SnapshotWriter`), read (`SnapshotReader`) and
catalogue (`list_snapshots`, `delete_snapshot`, `find_orphans`).

The work lives in `writer`, `reader` and `catalog`; this module only gathers their public
names so callers need not know the split.
"""

from snapshotter.storage.catalog import delete_snapshot, find_orphans, list_snapshots
from snapshotter.storage.commit import commit_snapshot
from snapshotter.storage.reader import SnapshotReader
from snapshotter.storage.tasks import TransferStatus, TransferTasks
from snapshotter.storage.writer import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_WORKERS,
    Progress,
    ProgressFn,
    SnapshotWriter,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_WORKERS",
    "Progress",
    "ProgressFn",
    "SnapshotReader",
    "SnapshotWriter",
    "TransferTasks",
    "TransferStatus",
    "commit_snapshot",
    "delete_snapshot",
    "find_orphans",
    "list_snapshots",
]
