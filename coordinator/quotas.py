"""Per-tenant limits on snapshots: the decision is a pure function, the limits a file.

    $SNAPSHOTTER_HOME/tenants.json
    {"tenants": {"acme": {"max_stored_bytes": 53687091200, "max_concurrent_freezes": 2}}}

`snapshotter tenant set T [--max-stored 50G] [--max-freezes 2]` and `tenant show` edit and read
it on the coordinator's host; the coordinator re-reads it when it changes. A tenant with no entry,
or a limit left out, is unlimited. A freeze (a person's, a policy's or the provider's) that
would go past a limit is refused before any rank is touched, naming the limit and what to do.

Stored bytes are the sum of the tenant's committed snapshots' stored sizes: chunks a snapshot
shares with another are counted in each (what the tenant would free by deleting one is less).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.coordinator.tenantfile import TenantFile


@dataclass(frozen=True)
class Limits:
    max_stored_bytes: int | None = None
    max_concurrent_freezes: int | None = None


def check_freeze(tenant: str, limits: Limits, freezing: int, stored_bytes: int) -> None:
    """Whether a new freeze of a tenant with `freezing` freezes running and `stored_bytes` in
    committed snapshots may start. Raises FreezeRefused naming the limit."""
    if limits.max_concurrent_freezes is not None and freezing >= limits.max_concurrent_freezes:
        raise errors.FreezeRefused(
            f"tenant {tenant!r} already has {freezing} freeze(s) running, its limit is "
            f"{limits.max_concurrent_freezes}",
            "retry when one finished, or raise it (`snapshotter tenant set --max-freezes`)",
        )
    if limits.max_stored_bytes is not None and stored_bytes >= limits.max_stored_bytes:
        raise errors.FreezeRefused(
            f"tenant {tenant!r} stores {stored_bytes} bytes of snapshots, its quota is "
            f"{limits.max_stored_bytes}",
            "delete snapshots it no longer needs (`snapshotter delete`, or `--keep` on its "
            "jobs), or raise the quota (`snapshotter tenant set --max-stored`)",
        )


class TenantLimits:
    """The limits file of one coordinator; a missing file limits nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = TenantFile(path, _parse, _dump)

    def get(self, tenant: str) -> Limits:
        return self._file.all().get(tenant, Limits())

    def all(self) -> dict[str, Limits]:
        return self._file.all()

    def set(self, tenant: str, limits: Limits) -> None:
        self._file.put(tenant, limits)


def _parse(tenant: str, d: dict[str, Any]) -> Limits:
    values = {k: d.get(k) for k in ("max_stored_bytes", "max_concurrent_freezes")}
    for k, v in values.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"{tenant}.{k} = {v!r} is not a whole number >= 0")
    return Limits(**values)


def _dump(x: Limits) -> dict[str, Any]:
    return {k: v for k, v in asdict(x).items() if v is not None}
