"""The snapshot catalogue as the coordinator serves it: committed snapshots are the store's
manifests (snapshotter/storage/format.py), read here into typed messages; orphans of failed
freezes are gc's (gc.py).

A freeze's spans (meta "spans", coordinator/freeze.py) are read by `show` only: a listing of
every snapshot does not parse hundreds of them per snapshot. Manifests from before spans
existed have none."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

from snapshotter import errors
from snapshotter.coordinator.gc import DEFAULT_MIN_AGE_S, checkpoint_gc_report, gc_report
from snapshotter.rpc import convert
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.transfer import SnapshotReader, delete_snapshot
from snapshotter.storage.transfer import list_snapshots as snapshot_ids
from snapshotter.v1 import common_pb2, coordinator_pb2

pb = coordinator_pb2


def summary(sid: str, m: fmt.Manifest) -> pb.SnapshotSummary:
    meta = m.meta
    return pb.SnapshotSummary(
        snapshot_id=sid,
        job_id=str(meta.get("source_job") or ""),
        created=m.created_at,
        ranks=len(meta.get("ranks", [])),
        nodes=list(meta.get("nodes", [])),
        stored_bytes=m.stored_size,
        raw_bytes=m.raw_size,
        stats=convert.parse(meta.get("stats") or {}, pb.FreezeStats),
        tenant=str((meta.get("job") or {}).get("tenant") or fmt.DEFAULT_TENANT),
    )


def list_snapshots(store: ObjectStore, job_id: str) -> pb.SnapshotList:
    """Committed snapshots (of `job_id`, or all), oldest first; unreadable ones are skipped
    (`show` names what is wrong with one)."""
    out: list[pb.SnapshotSummary] = []
    for sid in snapshot_ids(store):
        try:
            m = SnapshotReader(store, sid).manifest()
        except errors.SnapshotterError:
            continue
        if job_id and m.meta.get("source_job") != job_id:
            continue
        out.append(summary(sid, m))
    out.sort(key=lambda s: s.created)
    return pb.SnapshotList(snapshots=out)


def newest(store: ObjectStore, job_id: str) -> str:
    """The job's newest committed snapshot ("" if it has none)."""
    listed = list_snapshots(store, job_id).snapshots
    return max(listed, key=lambda s: (s.created, s.snapshot_id)).snapshot_id if listed else ""


def show(store: ObjectStore, snapshot_id: str) -> pb.SnapshotDetail:
    m = SnapshotReader(store, snapshot_id).manifest()
    meta: dict[str, Any] = dict(m.meta)
    job = dict(meta.get("job", {}))
    # Snapshots from before the environment was cut down kept it whole: never show it.
    kept = {k: v for k, v in (job.get("env") or {}).items() if k in _kept()}
    detail = pb.SnapshotDetail(
        summary=summary(snapshot_id, m),
        job=convert.parse({**job, "env": kept}, common_pb2.JobSpec),
        freeze_id=str(meta.get("freeze_id", "")),
        targets={str(k): int(v) for k, v in (meta.get("targets") or {}).items()},
        rank_records=[convert.parse(r, common_pb2.RankRecord) for r in meta.get("ranks", [])],
        env_omitted=list(meta.get("env_omitted", [])),
    )
    detail.summary.stats.spans.extend(
        convert.parse(s, pb.Span) for s in meta.get("spans") or [] if isinstance(s, dict)
    )
    return detail


def _kept() -> frozenset[str]:
    from snapshotter.launch.spec import KEPT_ENV

    return KEPT_ENV


def delete(store: ObjectStore, snapshot_id: str) -> pb.DeleteReply:
    SnapshotReader(store, snapshot_id).manifest()  # SnapshotNotFound if absent
    delete_snapshot(store, snapshot_id)
    return pb.DeleteReply(deleted=snapshot_id)


def gc(
    store: ObjectStore, writing: AbstractSet[str], now: float, req: pb.GcRequest
) -> pb.GcReport:
    """Orphaned chunks (no manifest) older than the grace period, listed or deleted. The
    grace period also covers freezes of a coordinator that died mid-upload (their agents may
    still be writing)."""
    min_age = req.min_age_s if req.HasField("min_age_s") else DEFAULT_MIN_AGE_S
    report = gc_report(store, writing, now=now, min_age_s=min_age, delete=req.delete)
    report["checkpoints"] = checkpoint_gc_report(store, now=now, min_age_s=min_age,
                                                 delete=req.delete)  # fmt: skip
    return convert.parse(report, pb.GcReport)
