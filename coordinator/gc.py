"""Garbage collection of orphaned snapshots: chunks under `snapshots/<id>/` with no manifest.

A freeze that fails cleans up after itself, but one whose coordinator or agent is killed
mid-upload leaves its chunks behind, invisible to `list` and `thaw` and never reclaimed. A
freeze still uploading looks exactly the same, so an orphan is collected only when

    not in_progress(id)  and  now - newest_object_mtime(id) >= min_age_s

`in_progress` covers this coordinator's own freezes; the grace period covers everyone else's
(another coordinator on the same store, a stalled upload). The decision (`collectable`) is pure;
`gc_report` does the listing and, when asked, the deleting. This module must never delete a
committed snapshot: it re-checks for a manifest right before each delete.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from snapshotter import errors
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectInfo, ObjectStore
from snapshotter.storage.catalog import delete_snapshot, find_orphans

DEFAULT_MIN_AGE_S = 3600.0

# `action` of an orphan in the report.
KEPT = "kept"
COLLECTABLE = "collectable"  # a dry run: would be deleted
DELETED = "deleted"
FAILED = "failed"  # a delete was tried and left keys behind (or the store refused)

IN_PROGRESS = "being written by a freeze of this coordinator"
COMMITTED_MEANWHILE = "committed while gc ran"


def check_min_age(min_age_s: float) -> float:
    """Return `min_age_s` if usable as a grace period.

    Raises:
        InvalidArgument: negative, NaN or infinite.
    """
    if not math.isfinite(min_age_s) or min_age_s < 0:
        raise errors.InvalidArgument(
            f"gc minimum age {min_age_s!r} is not a non-negative number of seconds",
            "pass --min-age SECONDS, longer than your longest freeze upload (default 3600)",
        )
    return min_age_s


def collectable(
    orphans: Mapping[str, float],
    in_progress: AbstractSet[str],
    now: float,
    min_age_s: float,
) -> tuple[list[str], dict[str, str]]:
    """Split orphans (id -> newest object mtime, epoch seconds) into the ids to collect, sorted,
    and the ids to keep with the reason why.

    An orphan whose newest object is dated after `now` (clock skew between us and the store)
    has a negative age and is kept, which is the safe side.

    Raises:
        InvalidArgument: `min_age_s` is negative or not finite.
    """
    check_min_age(min_age_s)
    collect: list[str] = []
    kept: dict[str, str] = {}
    for sid in sorted(orphans):
        age = now - orphans[sid]
        if sid in in_progress:
            kept[sid] = IN_PROGRESS
        elif age < min_age_s:
            kept[sid] = (
                f"newest object {max(age, 0.0):.0f}s old, within the {min_age_s:.0f}s grace "
                "period (a freeze may still be writing it)"
            )
        else:
            collect.append(sid)
    return collect, kept


def gc_report(
    store: ObjectStore,
    in_progress: AbstractSet[str],
    *,
    now: float,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    delete: bool = False,
) -> dict[str, Any]:
    """List the orphans of `store` and what gc does with each; with `delete`, delete the
    collectable ones. The result is JSON-ready (an RPC reply, rendered by `snapshotter gc`):

        {"store": str, "now": float, "min_age_s": float, "delete": bool,
         "orphans": [{"snapshot_id": str, "objects": int, "bytes": int,
                      "newest_age_s": float, "action": "kept" | "collectable" | "deleted"
                      | "failed", "reason": str, "failed_keys": [str]}],
         "summary": {"orphans", "objects", "bytes", "kept", "collected",
                     "collected_bytes", "failed", "failed_keys": int}}

    "collected" counts "collectable" in a dry run and "deleted" otherwise. Deleting goes on
    past a failing orphan; a failure is reported in its entry, not raised.

    Raises:
        StorageUnavailable: the store could not be listed.
        InvalidArgument: `min_age_s` is negative or not finite.
    """
    check_min_age(min_age_s)
    found: dict[str, list[ObjectInfo]] = {}
    for sid in find_orphans(store):
        objects = list(store.list_objects(fmt.snapshot_prefix(sid)))
        mkey = fmt.manifest_key(sid)
        # Gone (deleted by someone else) or committed since find_orphans looked: not orphans.
        if objects and all(o.key != mkey for o in objects):
            found[sid] = objects
    newest = {sid: max(o.mtime for o in objs) for sid, objs in found.items()}
    collect, kept = collectable(newest, in_progress, now, min_age_s)

    entries: dict[str, dict[str, Any]] = {}
    for sid, objs in found.items():
        entries[sid] = {
            "snapshot_id": sid,
            "objects": len(objs),
            "bytes": sum(o.size for o in objs),
            "newest_age_s": round(now - newest[sid], 3),
            "action": KEPT if sid in kept else COLLECTABLE,
            "reason": kept.get(sid, f"no manifest and untouched for {min_age_s:.0f}s or more"),
            "failed_keys": [],
        }
    if delete:
        for sid in collect:
            entries[sid].update(_delete_orphan(store, sid))
    orphans = [entries[sid] for sid in sorted(entries)]
    return {
        "store": store.describe(),
        "now": now,
        "min_age_s": min_age_s,
        "delete": delete,
        "orphans": orphans,
        "summary": _summary(orphans),
    }


def _delete_orphan(store: ObjectStore, sid: str) -> dict[str, Any]:
    """Delete one orphan; return the fields of its report entry that change."""
    # delete_snapshot also deletes committed snapshots: make sure this one still is not. A
    # commit landing between this check and the delete is the residual race the grace
    # period exists for (its chunks would have to be older than min_age_s).
    try:
        if store.head(fmt.manifest_key(sid)) is not None:
            return {"action": KEPT, "reason": COMMITTED_MEANWHILE}
        failed = delete_snapshot(store, sid)
    except errors.SnapshotNotFound:
        return {"action": DELETED, "reason": "already deleted by someone else"}
    except errors.StorageUnavailable as e:
        return {"action": FAILED, "reason": str(e)}
    if failed:
        return {
            "action": FAILED,
            "reason": f"{len(failed)} object(s) could not be deleted; run gc again",
            "failed_keys": failed,
        }
    return {"action": DELETED}


def _summary(orphans: list[dict[str, Any]]) -> dict[str, int]:
    collected = [o for o in orphans if o["action"] in (COLLECTABLE, DELETED)]
    return {
        "orphans": len(orphans),
        "objects": sum(o["objects"] for o in orphans),
        "bytes": sum(o["bytes"] for o in orphans),
        "kept": sum(o["action"] == KEPT for o in orphans),
        "collected": len(collected),
        "collected_bytes": sum(o["bytes"] for o in collected),
        "failed": sum(o["action"] == FAILED for o in orphans),
        "failed_keys": sum(len(o["failed_keys"]) for o in orphans),
    }
