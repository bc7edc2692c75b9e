"""Committing a snapshot whose streams were written by several writers (one per node agent).

The coordinator gathers each node's StreamInfo, checks that every chunk is in the store with
its exact size, and only then writes the manifest: the one write that makes a snapshot exist.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from snapshotter.errors import InvalidArgument, StorageUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.signing import Signer


def check_stored(
    store: ObjectStore,
    manifest: fmt.Manifest,
    workers: int = 8,
    put_now: Collection[str] = (),
) -> None:
    """Every chunk of the manifest is in the store with its recorded size.

    `put_now`: shared chunks' keys whose PUT the store acknowledged during this freeze (S3 is
    read-after-write consistent): not asked again. Every other chunk is, above all those a
    writer took from the job's previous snapshot without a request.

    Raises:
        StorageUnavailable: a chunk is missing or has another size (names up to five).
    """
    # A shared chunk is checked once however many streams use it, and only for presence: its
    # object may be another writer's encoding of the same content.
    confirmed = set(put_now)
    chunks = [
        c
        for c in {c.key: c for _, c in manifest.chunks()}.values()
        if not (c.content_addressed and c.key in confirmed)
    ]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        sizes = list(pool.map(lambda c: store.head(c.key), chunks))
    bad = [
        f"{c.key} ({'missing' if size is None else f'{size} bytes'}, expected {c.stored_size})"
        for c, size in zip(chunks, sizes, strict=True)
        if size is None or (size != c.stored_size and not c.content_addressed)
    ]
    if bad:
        raise StorageUnavailable(
            f"{len(bad)} chunk(s) of snapshot {manifest.snapshot_id!r} are not in "
            f"{store.describe()} as written: {', '.join(bad[:5])}"
            + (" ..." if len(bad) > 5 else ""),
            "the object store lost or altered writes; check its health, then freeze again",
        )


def commit_snapshot(
    store: ObjectStore,
    snapshot_id: str,
    streams: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any],
    put_now: Collection[str] = (),
    signer: Signer | None = None,
    sealed: fmt.Sealing | None = None,
    stamp: Callable[[], Mapping[str, Any]] | None = None,
) -> fmt.Manifest:
    """Write the manifest of `snapshot_id` from streams given as `StreamInfo.to_dict()`.
    `put_now`: as for `check_stored`. `signer`: signs the manifest (signing.py); its
    signature is written first, so a committed snapshot is signed from its first moment.
    `sealed`: the data key the streams' chunks were sealed with (format version 3).
    `stamp`: called once every chunk is checked, just before the manifest is signed and
    written; what it returns is added to meta (a freeze records there how long its commit
    took), so it is covered by the checksum and the signature like the rest.

    Raises:
        InvalidArgument: a stream description or meta is malformed, or the id is taken.
        StorageUnavailable: a chunk is not stored as described, or the write failed.
    """
    try:
        infos = {n: fmt.stream_from_dict(n, s) for n, s in streams.items()}
        manifest = fmt.Manifest(
            snapshot_id=snapshot_id,
            created_at=time.time(),
            meta=dict(meta),
            streams=infos,
            version=fmt.version_for(infos, sealed),  # format 1 stays readable by old readers
            sealed=sealed,
        )
        fmt.validate(manifest)
    except (fmt.ManifestError, KeyError, TypeError, ValueError) as e:
        raise InvalidArgument(
            f"cannot commit snapshot {snapshot_id!r}: {e}",
            "pass only JSON-serializable values in meta and streams as StreamInfo.to_dict()",
        ) from e
    check_stored(store, manifest, put_now=put_now)
    # Serialized once, after the stamp: the manifest of a 16,384-rank job takes a tenth of a
    # second to encode, and a meta that is not JSON still fails here, before anything is written.
    try:
        if stamp is not None:
            manifest = dataclasses.replace(manifest, meta={**manifest.meta, **stamp()})
        body = manifest.to_json()
    except (fmt.ManifestError, TypeError, ValueError) as e:
        raise InvalidArgument(
            f"cannot commit snapshot {snapshot_id!r}: {e}",
            "pass only JSON-serializable values in meta (and in what the stamp adds)",
        ) from e
    key = fmt.manifest_key(snapshot_id)
    if store.head(key) is not None:
        raise InvalidArgument(
            f"snapshot {snapshot_id!r} was committed by someone else meanwhile",
            "use a unique snapshot id per freeze",
        )
    if signer is not None:
        store.put_bytes(fmt.signature_key(snapshot_id), signer.sign(body))
    store.put_bytes(key, body)
    return manifest
