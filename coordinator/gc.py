"""Garbage collection: orphaned snapshots, and shared chunks no snapshot references.

Orphans (format 1): chunks under `snapshots/<id>/` with no manifest.

A freeze that fails cleans up after itself, but one whose coordinator or agent is killed
mid-upload leaves its chunks behind, invisible to `list` and `thaw` and never reclaimed. A
freeze still uploading looks exactly the same, so an orphan is collected only when

    not in_progress(id)  and  now - newest_object_mtime(id) >= min_age_s

`in_progress` covers this coordinator's own freezes; the grace period covers everyone else's
(another coordinator on the same store, a stalled upload). The decision (`collectable`) is pure;
`gc_report` does the listing and, when asked, the deleting. This module must never delete a
committed snapshot: it re-checks for a manifest right before each delete.

Shared chunks (format 2, `chunks/<sha256>`) are reference-counted by manifests: one is swept
when

    no committed manifest lists it  and  now - its mtime >= min_age_s  and  not busy

`busy`: a freeze of this coordinator is writing (its agents may have found the chunk stored and
not yet committed the manifest that lists it). The grace period covers other coordinators'
freezes, whose new chunks are young; one of theirs that found an old unreferenced chunk stored
commits only after checking every chunk is still there (commit.py), so a sweep racing it fails
that freeze cleanly rather than breaking a snapshot. Manifests are listed again right before
the deletes, so a snapshot committed meanwhile keeps its chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

from snapshotter import errors
from snapshotter.checkpoint import catalog
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectInfo, ObjectMissing, ObjectStore
from snapshotter.storage.catalog import delete_snapshot, find_orphans, list_snapshots

DEFAULT_MIN_AGE_S = 3600.0

# `action` of an orphan in the report.
KEPT = "kept"
COLLECTABLE = "collectable"  # a dry run: would be deleted
DELETED = "deleted"
FAILED = "failed"  # a delete was tried and left keys behind (or the store refused)

IN_PROGRESS = "being written by a freeze of this coordinator"
BUSY = "a freeze of this coordinator is writing; shared chunks are swept when none is"
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


def sweepable(
    chunks: Mapping[str, float], referenced: AbstractSet[str], busy: bool, now: float,
    min_age_s: float,
) -> tuple[list[str], int, str]:  # fmt: skip
    """Of the shared chunks (key -> mtime), the keys to delete, sorted; how many unreferenced
    ones are kept, and why.

    Raises:
        InvalidArgument: `min_age_s` is negative or not finite.
    """
    check_min_age(min_age_s)
    unreferenced = sorted(k for k in chunks if k not in referenced)
    if busy and unreferenced:
        return [], len(unreferenced), BUSY
    old = [k for k in unreferenced if now - chunks[k] >= min_age_s]
    kept = len(unreferenced) - len(old)
    why = f"written in the last {min_age_s:.0f}s (a freeze may still need them)" if kept else ""
    return old, kept, why


def referenced_chunks(store: ObjectStore) -> tuple[set[str], set[str]]:
    """The shared chunks committed manifests list, and the ids of those manifests.

    Raises:
        StorageUnavailable: the store could not be listed or read.
    """
    keys: set[str] = set()
    ids: set[str] = set()
    for sid in list_snapshots(store):
        try:
            m = fmt.Manifest.from_json(store.get_bytes(fmt.manifest_key(sid)))
        except ObjectMissing:
            continue  # deleted since listed
        except fmt.ManifestError:
            # Unreadable: its chunks are unknown, so none may go (the sweep keeps everything).
            raise errors.SnapshotCorrupt(
                f"manifest of snapshot {sid!r} in {store.describe()} is unreadable, so gc "
                "cannot tell which shared chunks it needs",
                f"delete it (`snapshotter delete {sid}`) or restore the manifest, then rerun gc",
            ) from None
        keys |= m.content_keys()
        ids.add(sid)
    return keys, ids


def sweep_chunks(
    store: ObjectStore, busy: Callable[[], bool], *, now: float, min_age_s: float, delete: bool
) -> dict[str, Any]:
    """The shared-chunk half of `gc_report`, as a plain GcChunks. `busy()`: whether a freeze
    of this coordinator writes now (asked at the start and again right before deleting)."""
    chunks = {o.key: o for o in store.list_objects(fmt.CONTENT_PREFIX)}
    referenced, seen = referenced_chunks(store)
    go, kept, why = sweepable({k: o.mtime for k, o in chunks.items()}, referenced, busy(), now,
                              min_age_s)  # fmt: skip
    failed: set[str] = set()
    if delete and go:
        # A snapshot committed since the listing above keeps what it lists.
        again, ids = referenced_chunks(store)
        if ids - seen:
            go = [k for k in go if k not in again]
        if busy():  # a freeze started meanwhile: it may have found one of them stored
            go, kept, why = [], kept + len(go), BUSY
        failed = set(store.delete_keys(go))
    gone = [k for k in go if k not in failed]
    unreferenced = [o for k, o in chunks.items() if k not in referenced]
    return {
        "stored": len(chunks),
        "stored_bytes": sum(o.size for o in chunks.values()),
        "unreferenced": len(unreferenced),
        "unreferenced_bytes": sum(o.size for o in unreferenced),
        "collected": len(gone),
        "collected_bytes": sum(chunks[k].size for k in gone),
        "kept": kept,
        "failed": len(failed),
        "reason": why,
    }


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
                     "collected_bytes", "failed", "failed_keys": int},
         "chunks": GcChunks (coordinator.proto) of the shared-chunk sweep}

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
        "chunks": sweep_chunks(
            store, lambda: bool(in_progress), now=now, min_age_s=min_age_s, delete=delete
        ),
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


def checkpoint_gc_report(
    store: ObjectStore, *, now: float, min_age_s: float = DEFAULT_MIN_AGE_S, delete: bool = False
) -> dict[str, Any]:
    """`gc_report` of the store's application-checkpoint namespace (checkpoint/catalog.py),
    after its abandoned parts: parts of a save that never committed, older than the grace
    period, are orphans too (their manifests go first, so their chunks are swept with the
    rest in the same run). Checkpoint uploads run in agents this coordinator does not track:
    the grace period alone protects them."""
    check_min_age(min_age_s)
    ckpts = catalog.checkpoint_store(store)
    entries = []
    for sid, age in sorted(catalog.orphan_parts(ckpts, min_age_s, now).items()):
        entry: dict[str, Any] = {
            "snapshot_id": sid, "objects": 1, "bytes": ckpts.head(fmt.manifest_key(sid)) or 0,
            "newest_age_s": round(age, 3), "action": COLLECTABLE,
            "reason": f"a part no committed checkpoint names, untouched for {min_age_s:.0f}s",
            "failed_keys": [],
        }  # fmt: skip
        if delete:
            try:
                failed = delete_snapshot(ckpts, sid)
            except errors.SnapshotNotFound:
                failed = []  # someone else's gc took it
            entry.update(action=FAILED if failed else DELETED, failed_keys=failed)
        entries.append(entry)
    report = gc_report(ckpts, frozenset(), now=now, min_age_s=min_age_s, delete=delete)
    report["orphans"] = entries + report["orphans"]
    report["summary"] = _summary(report["orphans"])
    return report
