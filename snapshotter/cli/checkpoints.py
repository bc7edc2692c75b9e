"""`snapshotter list --checkpoints` and `snapshotter delete --checkpoint NAME`.

Application checkpoints (snapshotter.checkpoint) are read straight from the store, with the
CLI's own credentials: `--store URL`, else SNAPSHOTTER_STORE, else the embedded daemon's
store. No daemon is needed to see what a training job saved.
"""

from __future__ import annotations

import argparse
import time

from snapshotter.checkpoint import catalog
from snapshotter.cli.output import emit_result, human_bytes, table
from snapshotter.config import Paths, default_home, store_url


def store_of(a: argparse.Namespace) -> str:
    return str(getattr(a, "store", None) or store_url(Paths(default_home())))


def list_checkpoints(a: argparse.Namespace) -> int:
    store = catalog.checkpoint_store(store_of(a))
    found = catalog.list_checkpoints(store)
    rows = [
        [c.name, str(len(c.parts)), human_bytes(c.raw_bytes), human_bytes(c.stored_bytes),
         time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(c.created_at))]
        for c in found
    ]  # fmt: skip
    result = {
        "store": store.describe(),
        "checkpoints": [
            {"name": c.name, "parts": list(c.parts), "ranks": len(c.parts),
             "raw_bytes": c.raw_bytes, "stored_bytes": c.stored_bytes, "created": c.created_at}
            for c in found
        ],
    }  # fmt: skip
    text = table(rows, ["CHECKPOINT", "RANKS", "SIZE", "STORED", "CREATED"]) if rows else \
        f"no checkpoints in {store.describe()}"  # fmt: skip
    emit_result(result, a.json, None, text)
    return 0


def delete_checkpoint(a: argparse.Namespace) -> int:
    store = catalog.checkpoint_store(store_of(a))
    left = catalog.delete(store, a.snapshot)
    note = f" ({len(left)} object(s) left for `snapshotter gc`)" if left else ""
    emit_result({"deleted": a.snapshot, "left": left}, a.json, None,
                f"deleted checkpoint {a.snapshot}{note}")  # fmt: skip
    return 0
