"""Application checkpoints through snapshotter's data path.

    import torch.distributed.checkpoint as dcp
    from snapshotter.checkpoint import reader, writer

    dcp.async_save(state, storage_writer=writer("s3://bucket/prefix"))
    dcp.load(state, storage_reader=reader("s3://bucket/prefix"))        # the newest

The URL is a store as SNAPSHOTTER_STORE takes it (default: $SNAPSHOTTER_STORE, else the node
agent's store). Checkpoints live in that store's `checkpoints/` namespace (catalog.py), are
listed by `snapshotter list --checkpoints`, and exist only once complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snapshotter.checkpoint.dcp import SnapshotterReader, SnapshotterWriter


def writer(url: str | None = None, *, slots: int = 2) -> SnapshotterWriter:
    """A DCP storage writer (and async stager) into the store `url`. Keep one per training
    run: it holds `slots` staging buffers (double buffering) and seeds each save's dedup with
    the previous one. `close()` it after the last save."""
    from snapshotter.checkpoint.dcp import SnapshotterWriter

    return SnapshotterWriter(url, slots=slots)


def reader(url: str | None = None, *, checkpoint_id: str | None = None) -> SnapshotterReader:
    """A DCP storage reader of checkpoint `checkpoint_id` in the store `url` (default: the
    newest committed one)."""
    from snapshotter.checkpoint.dcp import SnapshotterReader

    return SnapshotterReader(url, checkpoint_id=checkpoint_id)


__all__ = ["reader", "writer"]
