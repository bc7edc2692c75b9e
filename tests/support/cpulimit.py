"""A CPU limit on one process, as an operator's cgroup sets it (cgroup v2 `cpu.max`, or the v1
cpu controller's CFS quota on a hybrid machine like this one), and its removal."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _v2() -> bool:
    return (ROOT / "cgroup.controllers").exists()


def _home(pid: int) -> Path:
    """The cgroup of `pid` in the hierarchy that has the cpu controller."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if _v2() and hid == "0":
            return ROOT / path.lstrip("/")
        if not _v2() and "cpu" in ctrls.split(","):
            return ROOT / "cpu" / path.lstrip("/")
    raise RuntimeError(f"no cpu cgroup for pid {pid}")


@contextlib.contextmanager
def cpu_limit(pid: int, fraction: float) -> Iterator[Path]:
    """Run process `pid` (every thread) at most `fraction` of one CPU until the block ends;
    then it goes back to its cgroup and the one made here is removed."""
    home = _home(pid)
    base = ROOT if _v2() else ROOT / "cpu"
    cg = base / f"snapshotter-test-{os.getpid()}-{pid}"
    cg.mkdir()
    try:
        quota = max(1000, int(PERIOD_US * fraction))
        if _v2():
            (cg / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            (cg / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (cg / "cpu.cfs_quota_us").write_text(str(quota))
        (cg / "cgroup.procs").write_text(str(pid))
        try:
            yield cg
        finally:
            with contextlib.suppress(OSError):  # the process may be gone
                (home / "cgroup.procs").write_text(str(pid))
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:  # a task still leaving it
                time.sleep(0.1)
