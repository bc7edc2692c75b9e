"""Per-tenant limits: the freeze decision (pure) and the limits file the coordinator re-reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.cli.tenants import size
from snapshotter.coordinator.quotas import Limits, TenantLimits, check_freeze


def test_a_freeze_is_refused_at_each_limit_and_only_there() -> None:
    check_freeze("acme", Limits(), freezing=99, stored_bytes=10**15)  # no limits
    check_freeze("acme", Limits(max_stored_bytes=100, max_concurrent_freezes=2), 1, 99)
    with pytest.raises(errors.FreezeRefused, match="2 freeze.*limit is 2") as ei:
        check_freeze("acme", Limits(max_concurrent_freezes=2), freezing=2, stored_bytes=0)
    assert "--max-freezes" in ei.value.next_step
    with pytest.raises(errors.FreezeRefused, match="stores 100 bytes.*quota is 100") as ei:
        check_freeze("acme", Limits(max_stored_bytes=100), freezing=0, stored_bytes=100)
    assert "snapshotter delete" in ei.value.next_step


def test_the_limits_file_is_reread_when_it_changes_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    limits = TenantLimits(path)
    assert limits.get("acme") == Limits()
    limits.set("acme", Limits(max_stored_bytes=5))
    other = TenantLimits(path)  # the coordinator's own instance
    assert other.get("acme") == Limits(max_stored_bytes=5) and other.get("globex") == Limits()
    path.write_text('{"tenants": {"acme": {"max_concurrent_freezes": 1}}}')
    os.utime(path, (1, 1))  # a new mtime, whatever the clock's resolution
    assert other.get("acme") == Limits(max_concurrent_freezes=1)
    path.write_text('{"tenants": {"acme": {"max_concurrent_freezes": -1}}}')
    os.utime(path, (2, 2))
    with pytest.raises(errors.InvalidArgument, match="not a whole number"):
        other.get("acme")
    assert size("50G") == 50 << 30 and size("500MiB") == 500 << 20 and size("7") == 7
