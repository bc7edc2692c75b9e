"""A node's own checks for the cluster audit (snapshotter audit): what the product needs of
it, each an AuditCheck the coordinator compares across the cluster (coordinator/audit.py).

  criu      `criu check` of the CRIU the agent dumps with
  kernel    what the freeze and thaw paths use: memfd, pidfd_open and pidfd_getfd,
            userfaultfd, /proc/sys/kernel/ns_last_pid
  disk      free space where the agent stages images (failed under MIN_FREE_BYTES)
  storage   a probe object written to, read back from and deleted in the agent's store:
            MB/s each way (compared with the other nodes'); failed on any error
  gpus      NVML's view where the agent watches GPUs: fatal faults fail it; skipped without
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.sandbox.criu import criu_binary
from snapshotter.sandbox.tcp_repair import SYS_PIDFD_GETFD
from snapshotter.storage.api import ObjectStore
from snapshotter.v1 import common_pb2

MIN_FREE_BYTES = 2 << 30
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}


def check(name: str, status: str, detail: str = "", value: float = 0.0, unit: str = "",
          higher_is_better: bool = False) -> common_pb2.AuditCheck:  # fmt: skip
    return common_pb2.AuditCheck(name=name, status=status, detail=detail, value=value,
                                 unit=unit, higher_is_better=higher_is_better)  # fmt: skip


def criu_check() -> common_pb2.AuditCheck:
    try:
        criu = criu_binary()
    except errors.SnapshotterError as e:
        return check("criu", "failed", f"{e.cause} ({e.next_step})")
    try:
        p = subprocess.run([str(criu), "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return check("criu", "failed", f"{criu} check did not run: {e}")
    last = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    if p.returncode != 0:
        return check("criu", "failed", f"{criu} check exited {p.returncode}: {last[0]}")
    return check("criu", "ok", f"{criu}: {last[0]}")


def _syscall_exists(nr: int, *args: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(nr, *args)
    return ctypes.get_errno() != 38  # ENOSYS: the kernel lacks it; anything else: it is there


def kernel_check() -> common_pb2.AuditCheck:
    missing = []
    try:
        os.close(os.memfd_create("snapshotter-audit"))
    except OSError:
        missing.append("memfd_create")
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        missing.append("pidfd_open")
    if not _syscall_exists(SYS_PIDFD_GETFD, -1, -1, 0):
        missing.append("pidfd_getfd")
    nr = _SYS_USERFAULTFD.get(os.uname().machine)
    if nr is not None and not _syscall_exists(nr, 0):
        missing.append("userfaultfd")
    if not Path("/proc/sys/kernel/ns_last_pid").exists():
        missing.append("/proc/sys/kernel/ns_last_pid")
    if missing:
        return check("kernel", "failed", f"{os.uname().release} lacks {', '.join(missing)}")
    return check("kernel", "ok", os.uname().release)


def disk_check(staging: Path) -> common_pb2.AuditCheck:
    try:
        free = shutil.disk_usage(staging).free
    except OSError as e:
        return check("disk", "failed", f"{staging}: {e}")
    gib = free / (1 << 30)
    if free < MIN_FREE_BYTES:
        return check("disk", "failed", f"{gib:.1f} GiB free in {staging}, under "
                                       f"{MIN_FREE_BYTES >> 30} GiB", gib, "GiB")  # fmt: skip
    return check("disk", "ok", f"{gib:.1f} GiB free in {staging}", gib, "GiB")


def storage_checks(store: ObjectStore, node: str, nbytes: int) -> list[common_pb2.AuditCheck]:
    key = f"audit/{node}-{os.urandom(6).hex()}"
    data = os.urandom(max(1, nbytes))
    try:
        t = time.perf_counter()
        store.put_bytes(key, data)
        wrote = time.perf_counter() - t
        t = time.perf_counter()
        back = store.get_bytes(key)
        read = time.perf_counter() - t
    except (errors.SnapshotterError, LookupError, OSError) as e:
        cause = getattr(e, "cause", str(e))
        return [check("storage", "failed", f"{store.describe()}: {cause}")]
    finally:
        try:
            store.delete_keys([key])
        except (errors.SnapshotterError, OSError):
            pass  # unreachable store: reported above
    if back != data:
        return [check("storage", "failed", f"{store.describe()} returned other bytes")]
    mb = len(data) / 1e6
    return [check("storage_write", "ok", store.describe(), mb / wrote, "MB/s", True),
            check("storage_read", "ok", store.describe(), mb / read, "MB/s", True)]  # fmt: skip


def gpu_check(health: Any) -> common_pb2.AuditCheck:
    if health is None:
        return check("gpus", "skipped", "no NVIDIA driver on this node")
    fatal = health.faults(0.0, True)
    gpus = health.gpus()
    if fatal:
        f = fatal[-1]
        return check("gpus", "failed", f"{len(fatal)} fatal fault(s), the last: {f}",
                     len(gpus), "GPUs")  # fmt: skip
    return check("gpus", "ok", f"{len(gpus)} GPU(s), no fatal fault", len(gpus), "GPUs")


def node_checks(store: ObjectStore, node: str, staging: Path, storage_bytes: int,
                gpu_health: Any) -> list[common_pb2.AuditCheck]:  # fmt: skip
    return [criu_check(), kernel_check(), disk_check(staging),
            *storage_checks(store, node, storage_bytes), gpu_check(gpu_health)]  # fmt: skip
