"""An agent ends the rank sandboxes its previous incarnation left: real processes."""

from __future__ import annotations

import subprocess
from pathlib import Path

from snapshotter.agent.orphans import reap_orphans, record, start_time


def test_recorded_processes_are_killed_and_reused_pids_are_spared(tmp_path: Path) -> None:
    registry = tmp_path / "sandboxes"
    left = subprocess.Popen(["sleep", "300"])
    other = subprocess.Popen(["sleep", "300"])
    try:
        record(registry, left.pid)
        # A record whose pid now belongs to another process (same pid, other start time).
        (registry / str(other.pid)).write_text("1")
        assert reap_orphans(registry) == [left.pid]
        assert left.wait(10) == -9
        assert other.poll() is None and start_time(other.pid) is not None
        assert list(registry.iterdir()) == []  # every record is forgotten
        assert reap_orphans(registry) == []
    finally:
        for p in (left, other):
            p.kill()
            p.wait(10)


def test_no_registry_is_nothing_to_do(tmp_path: Path) -> None:
    assert reap_orphans(tmp_path / "missing") == []
