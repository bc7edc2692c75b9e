"""What snapshots a store holds, and removing them.

A snapshot is listed only when committed (its manifest exists). Deletion removes the manifest
first, so a half-deleted snapshot is invisible rather than corrupt; chunks without a manifest
are orphans for gc. Nothing here reads chunk contents.
"""

from __future__ import annotations

from snapshotter.errors import InvalidArgument, SnapshotNotFound, StorageUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectMissing, ObjectStore


def _snapshot_dirs(store: ObjectStore) -> list[str]:
    out = []
    for name in store.list_dirs(fmt.SNAPSHOTS_PREFIX):
        try:
            out.append(fmt.validate_name(name))
        except ValueError:
            continue  # not ours
    return sorted(out)


def list_snapshots(store: ObjectStore) -> list[str]:
    """Ids of the committed snapshots, sorted. Read one with `SnapshotReader(store, id)`.

    Raises:
        StorageUnavailable: the store could not be listed.
    """
    return [s for s in _snapshot_dirs(store) if store.head(fmt.manifest_key(s)) is not None]


def snapshots_using(store: ObjectStore, key: str) -> list[str]:
    """Ids of the committed snapshots that list the shared chunk `key` (a damaged shared chunk
    breaks every one of them). Best effort: unreadable manifests are skipped.

    Raises:
        StorageUnavailable: the store could not be listed.
    """
    out = []
    for sid in list_snapshots(store):
        try:
            m = fmt.Manifest.from_json(store.get_bytes(fmt.manifest_key(sid)))
        except (ObjectMissing, fmt.ManifestError):
            continue
        if key in m.content_keys():
            out.append(sid)
    return out


def find_orphans(store: ObjectStore) -> list[str]:
    """Ids that have objects but no manifest: aborted or crashed writes, half-done deletes.

    A snapshot being written right now looks the same, so gc must only collect ids that are
    not in progress (e.g. still orphans after a grace period longer than a freeze).

    Raises:
        StorageUnavailable: the store could not be listed.
    """
    return [
        s
        for s in _snapshot_dirs(store)
        if store.head(fmt.manifest_key(s)) is None
        and next(iter(store.list_keys(fmt.snapshot_prefix(s))), None) is not None
    ]


def delete_snapshot(store: ObjectStore, snapshot_id: str) -> list[str]:
    """Delete a snapshot (committed or orphaned): the manifest first, then every chunk under
    its own prefix. Shared chunks stay: other snapshots may list them; gc sweeps those no
    manifest lists any more.

    Returns the keys that could not be deleted (the snapshot is already invisible; they are
    orphans for gc).

    Raises:
        SnapshotNotFound: nothing is stored under this id.
        StorageUnavailable: the store failed before the manifest was deleted (the snapshot is
            still there, intact).
        InvalidArgument: a malformed snapshot id.
    """
    try:
        prefix = fmt.snapshot_prefix(snapshot_id)
    except ValueError as e:
        raise InvalidArgument(str(e), "run `snapshotter list` for valid ids") from e
    mkey = fmt.manifest_key(snapshot_id)
    committed = store.head(mkey) is not None
    if committed:
        failed = store.delete_keys([mkey])
        if failed:
            raise StorageUnavailable(
                f"could not delete manifest {mkey} in {store.describe()}; snapshot "
                f"{snapshot_id!r} is still committed and intact",
                "check write/delete permissions on the store and retry",
            )
    keys = [k for k in store.list_keys(prefix) if k != mkey]
    if not committed and not keys:
        raise SnapshotNotFound(snapshot_id, store.describe())
    return store.delete_keys(keys)
