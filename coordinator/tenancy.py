"""Which tenant's jobs and snapshots a caller may see and act on.

A caller with a tenant-scoped token (`snapshotter token create --tenant T`, roles viewer and
operator) sees and acts on T's jobs and snapshots only. To it, another tenant's job or snapshot
does not exist: it gets the same JobNotFound / SnapshotNotFound as for an id nobody has, so a
guessed or leaked id tells nothing. Its launches and thaws are T's. Calls on the cluster
(nodes, drains, data links) are refused to it. Callers without a tenant (admin tokens,
certificates, root on the embedded daemon's socket) act on every tenant.

Decisions only: the caller comes from snapshotter/rpc/server.py, the records from core.py.
"""

from __future__ import annotations

from snapshotter import errors
from snapshotter.rpc.server import caller


def scope() -> str | None:
    """The tenant the current caller is limited to (None: every tenant)."""
    who = caller()
    return None if who is None else who.tenant


def require_cluster_scope(what: str) -> None:
    """Raises PermissionDenied for a tenant-scoped caller of a cluster-wide call."""
    who = caller()
    if who is not None and who.tenant is not None:
        raise errors.PermissionDenied(
            f"{who} may not {what}: it acts on the cluster, not on one tenant's jobs",
            "ask the provider's admin (a token without --tenant)",
            identity=str(who),
        )


def check_job(job_id: str, tenant: str | None) -> None:
    """Raises JobNotFound when the job (of `tenant`; None: unknown) is not the caller's."""
    mine = scope()
    if mine is not None and tenant is not None and tenant != mine:
        raise errors.JobNotFound(job_id)


def check_snapshot(snapshot_id: str, tenant: str, where: str) -> None:
    """Raises SnapshotNotFound (as for a missing one in store `where`) when the snapshot of
    `tenant` is not the caller's."""
    mine = scope()
    if mine is not None and tenant != mine:
        raise errors.SnapshotNotFound(snapshot_id, where)


def check_tenant(tenant: str) -> None:
    """Raises PermissionDenied when a tenant's caller asks about another tenant (the same
    answer whether that tenant exists or not)."""
    who = caller()
    if who is not None and who.tenant is not None and tenant != who.tenant:
        raise errors.PermissionDenied(
            f"{who} sees its own tenant {who.tenant!r} only",
            f"ask about {who.tenant!r}, or ask the provider's admin",
            identity=str(who),
        )


def check_provider_freeze(job_id: str, opted_out: bool) -> None:
    """Raises FreezeRefused when the provider freezes a job whose tenant withheld consent."""
    if opted_out and scope() is None:
        raise errors.FreezeRefused(
            f"job {job_id} opted out of provider snapshots (run --no-provider-snapshots)",
            "only its tenant's tokens, and its own snapshot policy, may freeze it",
        )


def launch_tenant(requested: str) -> str:
    """The tenant a new job of this caller belongs to ("" for the default).

    Raises PermissionDenied when a scoped caller names another tenant."""
    mine = scope()
    if mine is None:
        return requested
    if requested and requested != mine:
        raise errors.PermissionDenied(
            f"a token of tenant {mine!r} may not launch jobs of tenant {requested!r}",
            f"drop --tenant, or pass --tenant {mine}",
        )
    return mine


def check_job_id_free(job_id: str, tenant: str | None) -> None:
    """A scoped caller naming an id another tenant's job has: refused without saying whose."""
    mine = scope()
    if mine is not None and tenant is not None and tenant != mine:
        raise errors.InvalidArgument(
            f"job id {job_id!r} is taken", "choose another --job-id (or leave it out)"
        )
