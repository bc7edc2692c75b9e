"""Tenants as a resource of the coordinator's API: what one holds (jobs, snapshots, stored
bytes, running freezes), its limits (quotas.py) and where its events go (webhooks.py).

A tenant is a name, not a record anyone creates: it exists once a job, a snapshot, a limit or a
webhook names it. `describe` is pure; the service gathers what it reads (service.py), and
tenancy.py decides what a caller may see: a tenant's caller its own tenant only, the provider
every one. Changing limits and webhooks is the provider's (ADMINISTER in the contract).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.coordinator.quotas import Limits
from snapshotter.coordinator.webhooks import check_url
from snapshotter.storage.format import validate_name
from snapshotter.v1 import coordinator_pb2

pb = coordinator_pb2


@dataclass(frozen=True)
class Held:
    """What a tenant holds now (the coordinator's jobs and the store's snapshots)."""

    jobs: int = 0
    active_jobs: int = 0
    freezing: int = 0
    snapshots: int = 0
    stored_bytes: int = 0


def describe(tenant: str, limits: Limits, held: Held, webhook_url: str | None,
             data_key_id: str | None) -> pb.TenantInfo:  # fmt: skip
    info = pb.TenantInfo(
        tenant=tenant, stored_bytes=held.stored_bytes, snapshots=held.snapshots,
        jobs=held.jobs, active_jobs=held.active_jobs, freezing=held.freezing,
        webhook_url=webhook_url or "", data_key_id=data_key_id or "",
    )  # fmt: skip
    if limits.max_stored_bytes is not None:
        info.max_stored_bytes = limits.max_stored_bytes
    if limits.max_concurrent_freezes is not None:
        info.max_concurrent_freezes = limits.max_concurrent_freezes
    return info


def tally(tenant: str, jobs: Iterable[tuple[str, bool, bool]],
          snapshots: Iterable[tuple[str, int]]) -> Held:  # fmt: skip
    """`jobs`: (tenant, active, freezing) of every job; `snapshots`: (tenant, stored bytes)
    of every committed snapshot."""
    mine = [(active, freezing) for t, active, freezing in jobs if t == tenant]
    sizes = [n for t, n in snapshots if t == tenant]
    return Held(jobs=len(mine), active_jobs=sum(a for a, _ in mine),
                freezing=sum(f for _, f in mine), snapshots=len(sizes),
                stored_bytes=sum(sizes))  # fmt: skip


def check_name(tenant: str) -> str:
    """Raises InvalidArgument for a name no tenant can have."""
    try:
        return validate_name(tenant, "tenant")
    except ValueError as e:
        raise errors.InvalidArgument(str(e), "name the tenant as `run --tenant` does") from e


def new_limits(old: Limits, req: pb.SetTenantRequest) -> Limits:
    """The limits after `req` (a field left out keeps its value, -1 lifts it)."""

    def value(field: str, before: int | None) -> int | None:
        if not req.HasField(field):
            return before
        v = int(getattr(req, field))
        if v < -1:
            raise errors.InvalidArgument(f"{field} = {v}", "pass 0 or more, or -1 for unlimited")
        return None if v == -1 else v

    return Limits(max_stored_bytes=value("max_stored_bytes", old.max_stored_bytes),
                  max_concurrent_freezes=value("max_concurrent_freezes",
                                               old.max_concurrent_freezes))  # fmt: skip


def new_webhook_url(req: pb.SetTenantRequest) -> str | None:
    """The webhook URL `req` asks for (None: none); raises InvalidArgument for a bad one."""
    return check_url(req.webhook_url) if req.webhook_url else None
