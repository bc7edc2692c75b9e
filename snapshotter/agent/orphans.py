"""Rank sandboxes outliving their agent: found and ended when the agent starts again.

A rank cannot be frozen, thawed or even have its output read without the agent that started
it, and one that CRIU had stopped when its agent died may never run again. So every sandbox
the agent starts is recorded (init pid and the kernel's start time for that pid, so a reused
pid is never mistaken for it), and a starting agent kills whatever its previous incarnation
left alive. Killing a sandbox's init ends its whole PID namespace.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger(__name__)


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def record(registry: Path, pid: int) -> None:
    started = start_time(pid)
    if started is None:
        return
    registry.mkdir(parents=True, exist_ok=True)
    (registry / str(pid)).write_text(started)


def forget(registry: Path, pid: int) -> None:
    """The sandbox ended under its agent: its record goes (records never pile up)."""
    (registry / str(pid)).unlink(missing_ok=True)


def reap_orphans(registry: Path, spare: Collection[int] = ()) -> list[int]:
    """Kill every recorded sandbox still alive (same pid, same start time) but those in
    `spare` (the keeper holds them for this agent to re-adopt); forget the others."""
    killed: list[int] = []
    if not registry.is_dir():
        return killed
    for entry in registry.iterdir():
        try:
            pid = int(entry.name)
            recorded = entry.read_text().strip()
        except (ValueError, OSError):
            continue
        if pid in spare:
            continue
        if start_time(pid) == recorded:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        entry.unlink(missing_ok=True)
    if killed:
        log.warning("killed %d rank sandbox(es) left by this node's previous agent: %s",
                    len(killed), killed)  # fmt: skip
    return killed
