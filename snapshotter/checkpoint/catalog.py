"""Where application checkpoints live in a store, and which of them exist.

A checkpoint is stored with the snapshot format (storage/format.py) in its own namespace,
`checkpoints/` of the store (storage/prefixed.py), so content dedup spans checkpoints of every
job in that store and never touches process snapshots:

    checkpoints/snapshots/<name>.part00003/manifest.json   one rank's data (stream "data")
    checkpoints/snapshots/<name>/manifest.json             the checkpoint: DCP's metadata
                                                          (stream "metadata") and its parts
    checkpoints/chunks/<sha256>                           content, shared

Each rank's part is committed by whoever uploads it (the node agent) as soon as its bytes are
stored; the checkpoint manifest is committed last, by DCP's coordinator rank, once every part
is committed. A checkpoint therefore exists exactly when its manifest does: a save killed
halfway leaves parts no listing shows (`orphan_parts`, deleted by gc after a grace period).
Nothing here imports torch.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from snapshotter.errors import CheckpointNotFound, InvalidArgument, SnapshotNotFound
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectMissing, ObjectStore
from snapshotter.storage.catalog import delete_snapshot, list_snapshots
from snapshotter.storage.prefixed import PrefixedStore
from snapshotter.storage.url import open_store

PREFIX = "checkpoints/"
KIND = "dcp-checkpoint"
PART_KIND = "dcp-part"
DATA_STREAM = "data"
METADATA_STREAM = "metadata"
# Every item of a part starts on a page, so an unchanged tensor is stored as the same chunks
# whatever moved before it (the chunker cuts on page boundaries: storage/chunking.py).
ALIGN = 4096
_PART_RE = re.compile(r"^(?P<name>.+)\.part(?P<index>\d{5})$")


def checkpoint_store(url: str | ObjectStore) -> ObjectStore:
    """The checkpoint namespace of the store a URL names (as SNAPSHOTTER_STORE takes it)."""
    store = open_store(url) if isinstance(url, str) else url
    return PrefixedStore(store, PREFIX)


def check_name(name: str) -> str:
    """A checkpoint name: a snapshot id that is not a part's."""
    try:
        fmt.validate_name(name, "checkpoint name")
    except ValueError as e:
        raise InvalidArgument(
            str(e), "name checkpoints with letters, digits, '.', '_' and '-' (at most 128)"
        ) from e
    if _PART_RE.match(name) or len(name) > 118:
        raise InvalidArgument(
            f"checkpoint name {name!r} is reserved or too long (at most 118 characters, not "
            "ending in .partNNNNN)",
            "choose another checkpoint_id",
        )
    return name


def new_name(now: float | None = None) -> str:
    """A fresh, sortable checkpoint name for a save that was given none."""
    t = time.time() if now is None else now
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(t))
    return f"ckpt-{stamp}.{int(t * 1000) % 1000:03d}"


def part_id(name: str, index: int) -> str:
    if not 0 <= index < 100_000:
        raise InvalidArgument(f"rank index {index} is out of range", "save from < 100000 ranks")
    return f"{name}.part{index:05d}"


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(lengths: list[int]) -> list[int]:
    """The offset of each item in a part's data stream: back to back, each on a page."""
    offsets, at = [], 0
    for n in lengths:
        offsets.append(at)
        at = aligned(at + n)
    return offsets


@dataclass(frozen=True)
class CheckpointInfo:
    name: str
    created_at: float
    parts: tuple[str, ...]
    raw_bytes: int  # the data of every part
    stored_bytes: int  # what those parts' chunks take in the store (shared chunks counted)
    meta: dict[str, Any]


def read_manifest(store: ObjectStore, snapshot_id: str) -> fmt.Manifest:
    """The manifest of a checkpoint or of one of its parts.

    Raises:
        CheckpointNotFound: there is none by that id.
    """
    try:
        return fmt.Manifest.from_json(store.get_bytes(fmt.manifest_key(snapshot_id)))
    except ObjectMissing:
        raise CheckpointNotFound(
            f"no checkpoint or part {snapshot_id!r} in {store.describe()}",
            "run `snapshotter list --checkpoints` for the checkpoints there",
        ) from None


def read(store: ObjectStore, name: str) -> tuple[fmt.Manifest, CheckpointInfo]:
    """The committed checkpoint `name` of a checkpoint store.

    Raises:
        CheckpointNotFound: no checkpoint of that name (never committed, or deleted).
        SnapshotCorrupt / StorageUnavailable: as for any manifest.
    """
    check_name(name)
    try:
        manifest = read_manifest(store, name)
    except CheckpointNotFound:
        raise CheckpointNotFound(
            f"no checkpoint {name!r} in {store.describe()}",
            "run `snapshotter list --checkpoints` for the checkpoints there",
        ) from None
    if manifest.meta.get("kind") != KIND:
        raise CheckpointNotFound(f"{name!r} in {store.describe()} is not a checkpoint",
                               "run `snapshotter list --checkpoints`")  # fmt: skip
    parts = tuple(str(p) for p in manifest.meta.get("parts", []))
    return manifest, CheckpointInfo(
        name=name,
        created_at=manifest.created_at,
        parts=parts,
        raw_bytes=int(manifest.meta.get("raw_bytes", 0)),
        stored_bytes=int(manifest.meta.get("stored_bytes", 0)),
        meta=dict(manifest.meta),
    )


def list_checkpoints(store: ObjectStore) -> list[CheckpointInfo]:
    """Every committed checkpoint of a checkpoint store, oldest first. Parts and saves that
    never committed are not checkpoints and are not listed."""
    found = []
    for sid in list_snapshots(store):
        if _PART_RE.match(sid):
            continue
        try:
            found.append(read(store, sid)[1])
        except CheckpointNotFound:
            continue  # deleted while we listed
    return sorted(found, key=lambda c: (c.created_at, c.name))


def latest(store: ObjectStore) -> str:
    """The newest committed checkpoint's name.

    Raises:
        CheckpointNotFound: the store holds no checkpoint.
    """
    found = list_checkpoints(store)
    if not found:
        raise CheckpointNotFound(
            f"no checkpoint in {store.describe()}",
            "save one first (dcp.save or dcp.async_save with snapshotter.checkpoint.writer)",
        )
    return found[-1].name


def orphan_parts(
    store: ObjectStore, older_than_s: float, now: float | None = None
) -> dict[str, float]:
    """Parts no committed checkpoint names, by the age of their manifest in seconds: what a
    save that died (kill -9, a lost node) left. Only those older than `older_than_s`: a
    younger one may belong to a save still running."""
    t = time.time() if now is None else now
    ids = list_snapshots(store)
    named: set[str] = set()
    for sid in ids:
        if not _PART_RE.match(sid):
            try:
                named.update(read(store, sid)[1].parts)
            except CheckpointNotFound:
                continue
    orphans = {}
    for sid in ids:
        if _PART_RE.match(sid) and sid not in named:
            for info in store.list_objects(fmt.manifest_key(sid)):
                if t - info.mtime > older_than_s:
                    orphans[sid] = t - info.mtime
    return orphans


def delete(store: ObjectStore, name: str) -> list[str]:
    """Delete a checkpoint and its parts (manifests only: their chunks go with gc, which
    keeps whatever another checkpoint still uses). Returns the keys left undeleted."""
    _, info = read(store, name)
    left = delete_snapshot(store, name)  # the checkpoint is gone from the first moment
    for part in info.parts:
        try:
            left += delete_snapshot(store, part)
        except SnapshotNotFound:
            continue  # a concurrent delete or gc took it
    return left

