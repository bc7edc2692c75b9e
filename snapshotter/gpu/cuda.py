"""The real checkpoint driver: NVIDIA's checkpoint driver API through cuda-python.

Every call goes through `self.cu`, a module with the shape of `cuda.bindings.driver`
(functions return a tuple whose first item is a CUresult). Tests pass
`snapshotter.testing.gpu_fake.FakeCudaDriver` instead, so this exact code runs against a state
machine that answers misuse with the real error codes.

This module must never crash a node without the NVIDIA driver: `detect()` turns every way of
not having one into `None` and one log line.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from snapshotter.errors import GpuDriverError, GpuLockTimeout
from snapshotter.gpu.api import (
    LOCK_TIMEOUT_RESULTS,
    CheckpointDriver,
    GpuInfo,
    ProcessState,
    uuid_bytes,
    uuid_str,
)

log = logging.getLogger(__name__)

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
_DEV_RE = re.compile(r"^/dev/nvidia(\d+)$")


def _name(res: Any) -> str:
    name = getattr(res, "name", None)
    return str(name) if name else f"CUresult({int(res)})"


class CudaDriver(CheckpointDriver):
    """`CheckpointDriver` over `cuda.bindings.driver` (or a module shaped like it)."""

    def __init__(self, cu: Any, nvidia_proc: Path = NVIDIA_PROC) -> None:
        self.cu = cu
        self.nvidia_proc = nvidia_proc
        self._ok = cu.CUresult.CUDA_SUCCESS
        self._check("cuInit", 0, cu.cuInit(0))

    def _check(self, op: str, pid: int, ret: Any) -> Any:
        res = ret[0] if isinstance(ret, tuple) else ret
        if res != self._ok:
            name = _name(res)
            if op == "lock" and name in LOCK_TIMEOUT_RESULTS:
                raise GpuLockTimeout(
                    op, pid, name,
                    "a CUDA call or kernel of the rank did not finish in time; the job keeps "
                    "running; retry the freeze, or raise the GPU lock timeout",
                )
            raise GpuDriverError(op, pid, name)
        if isinstance(ret, tuple) and len(ret) > 1:
            return ret[1]
        return None

    # ---- CheckpointDriver ------------------------------------------------------------------

    def get_state(self, pid: int) -> ProcessState:
        state = self._check("get_state", pid, self.cu.cuCheckpointProcessGetState(pid))
        return ProcessState(int(state))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        self._check("lock", pid, self.cu.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        self._check("checkpoint", pid, self.cu.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] | None = None) -> None:
        args = None
        if gpu_pairs:
            args = self.cu.CUcheckpointRestoreArgs()
            pairs = []
            for old, new in gpu_pairs:
                p = self.cu.CUcheckpointGpuPair()
                p.oldUuid = self._uuid(old)
                p.newUuid = self._uuid(new)
                pairs.append(p)
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._check("restore", pid, self.cu.cuCheckpointProcessRestore(pid, args))

    def unlock(self, pid: int) -> None:
        self._check("unlock", pid, self.cu.cuCheckpointProcessUnlock(pid, None))

    def gpus(self) -> list[GpuInfo]:
        cu = self.cu
        n = self._check("gpus", 0, cu.cuDeviceGetCount())
        out = []
        for i in range(int(n)):
            dev = self._check("gpus", 0, cu.cuDeviceGet(i))
            uuid = self._check("gpus", 0, cu.cuDeviceGetUuid(dev))
            name = self._check("gpus", 0, cu.cuDeviceGetName(256, dev))
            mem = self._check("gpus", 0, cu.cuDeviceTotalMem(dev))
            text = name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)
            out.append(GpuInfo(uuid=uuid_str(bytes(uuid.bytes)), name=text, memory=int(mem)))
        return out

    def process_gpus(self, pid: int) -> list[GpuInfo] | None:
        minors = open_gpu_minors(pid)
        by_minor = minor_uuids(self.nvidia_proc)
        if not minors or not by_minor:
            return None
        try:
            node = {g.uuid: g for g in self.gpus()}
        except GpuDriverError:
            return None
        used = [node.get(by_minor.get(m, "")) for m in sorted(minors)]
        if any(g is None for g in used):
            return None
        return [g for g in used if g is not None]

    # ---- helpers ---------------------------------------------------------------------------

    def _uuid(self, text: str) -> Any:
        # CUuuid.bytes is read-only in cuda-python: write the 16 bytes behind its pointer.
        u = self.cu.CUuuid()
        ctypes.memmove(u.getPtr(), uuid_bytes(text), 16)
        return u


def open_gpu_minors(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """Minor numbers of the /dev/nvidiaN devices `pid` has open (empty if unreadable)."""
    minors: set[int] = set()
    try:
        fds = list((proc / str(pid) / "fd").iterdir())
    except OSError:
        return minors
    for fd in fds:
        try:
            m = _DEV_RE.match(os.readlink(fd))
        except OSError:
            continue
        if m:
            minors.add(int(m.group(1)))
    return minors


def parse_information(text: str) -> tuple[int, str] | None:
    """(device minor, GPU UUID) from a /proc/driver/nvidia/gpus/*/information file."""
    minor = re.search(r"^Device Minor:\s*(\d+)", text, re.M)
    uuid = re.search(r"^GPU UUID:\s*(GPU-[0-9a-fA-F-]+)", text, re.M)
    if not minor or not uuid:
        return None
    return int(minor.group(1)), "GPU-" + uuid.group(1)[4:].lower()


def minor_uuids(nvidia_proc: Path = NVIDIA_PROC) -> dict[int, str]:
    out: dict[int, str] = {}
    try:
        files = list(nvidia_proc.glob("*/information"))
    except OSError:
        return out
    for f in files:
        try:
            parsed = parse_information(f.read_text())
        except OSError:
            continue
        if parsed:
            out[parsed[0]] = parsed[1]
    return out


def detect(cu: Any = None) -> CudaDriver | None:
    """The real driver, or None (and one log line saying why) when this node cannot
    checkpoint GPU state: no NVIDIA driver, no GPU, or a driver without the checkpoint API."""
    try:
        if cu is None:
            import cuda.bindings.driver as real

            cu = real
        if not hasattr(cu, "cuCheckpointProcessLock"):
            log.info("GPU stage off: cuda-python has no checkpoint API (needs cuda-python>=12.8)")
            return None
        drv = CudaDriver(cu)
        n = drv.gpus()
        if not n:
            log.info("GPU stage off: the NVIDIA driver sees no GPU")
            return None
        # A driver older than the checkpoint API (r550) answers NOT_SUPPORTED even for us.
        try:
            drv.get_state(os.getpid())
        except GpuDriverError as e:
            if e.result == "CUDA_ERROR_NOT_SUPPORTED":
                log.info("GPU stage off: the NVIDIA driver has no checkpoint support (needs r550+)")
                return None
        return drv
    except Exception as e:  # noqa: BLE001 - any reason means "no GPU stage", never a crash
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.info("GPU stage off: no usable NVIDIA driver on this node (%s)", reason)
        return None
