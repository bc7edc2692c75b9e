"""GPU faults from NVML (`cuda.bindings.nvml`, part of cuda-python): XID errors and
uncorrected ECC errors, which the agent reports with its jobs so that the coordinator treats
the node as failing (`--recover auto` then thaws the job elsewhere).

A watcher thread waits on an NVML event set (XID critical errors and double-bit ECC errors,
where the device supports them) and, every poll, reads each device's volatile uncorrected ECC
count: a count above the one seen at start is a fault too (devices that deliver no events).
Which XIDs mean the GPU failed, rather than the job's own code, is `fatal_xid` (pure).

Every call goes through `self.nvml`, a module with the shape of `cuda.bindings.nvml`; tests
pass `snapshotter.testing.nvml_fake.FakeNvml`. Without the NVIDIA driver `detect()` returns None
(one log line, never an error).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from snapshotter.v1 import common_pb2

log = logging.getLogger(__name__)

# XIDs that name a failing GPU, its memory or its links, not the application (NVIDIA's XID
# catalogue): 48 double-bit ECC, 61/62 internal micro-controller, 63/64 row remapping
# (pending/failed), 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate,
# 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC. Others (13 graphics
# engine exception, 31 MMU fault, 43 stopped, 45 preemptive cleanup, ...) follow from what
# the job's code did: a rank that dies of them is a rank failure like any other.
FATAL_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})
MAX_FAULTS = 256  # kept per agent, newest last: enough for any job's lifetime on a bad node


def fatal_xid(xid: int) -> bool:
    return xid in FATAL_XIDS


@dataclass(frozen=True)
class GpuFault:
    uuid: str
    kind: str  # xid | ecc
    code: int  # the XID, or how many uncorrected ECC errors were added
    time: float  # epoch seconds
    fatal: bool
    detail: str


def fault_proto(f: GpuFault) -> common_pb2.GpuFault:
    return common_pb2.GpuFault(uuid=f.uuid, kind=f.kind, code=f.code, time=f.time,
                               fatal=f.fatal, detail=f.detail)  # fmt: skip


def ecc_faults(
    uuid: str, before: int | None, now: int | None, at: float
) -> list[GpuFault]:  # fmt: skip
    """A fault when a device's volatile uncorrected ECC count grew (pure)."""
    if before is None or now is None or now <= before:
        return []
    n = now - before
    return [GpuFault(uuid, "ecc", n, at, True, f"{n} uncorrected ECC error(s) on GPU {uuid}")]


class GpuHealth:
    """Watches every GPU of this node; `faults(since)` lists what it saw."""

    def __init__(self, nvml: Any, poll_s: float = 1.0) -> None:
        self.nvml = nvml
        self.poll_s = poll_s
        self._faults: deque[GpuFault] = deque(maxlen=MAX_FAULTS)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._handles: dict[int, str] = {}  # device handle -> uuid
        self._ecc: dict[str, int | None] = {}
        self._set: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> GpuHealth:
        """Open every device and start watching. Raises whatever NVML raises at init."""
        n = self.nvml
        n.init_v2()
        for i in range(n.device_get_count_v2()):
            h = n.device_get_handle_by_index_v2(i)
            uuid = str(n.device_get_uuid(h))
            self._handles[h] = uuid
            self._ecc[uuid] = self._ecc_count(h)
        self._set = n.event_set_create()
        mask = int(n.EventType.XID_CRITICAL_ERROR) | int(n.EventType.DOUBLE_BIT_ECC_ERROR)
        for h, uuid in self._handles.items():
            try:
                n.device_register_events(h, mask, self._set)
            except n.NotSupportedError:
                log.info("GPU %s delivers no XID events here; its ECC count is polled", uuid)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="gpu-health")
        self._thread.start()
        log.info("watching %d GPU(s) for XID and ECC errors", len(self._handles))
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 + self.poll_s)
        try:
            if self._set is not None:
                self.nvml.event_set_free(self._set)
            self.nvml.shutdown()
        except Exception as e:  # noqa: BLE001 - stopping: nothing left to do about it
            log.debug("NVML shutdown: %s", e)

    def gpus(self) -> dict[str, int | None]:
        """Every watched GPU's uuid and its uncorrected ECC count (None: ECC off)."""
        with self._lock:
            return {uuid: self._ecc.get(uuid) for uuid in self._handles.values()}

    def faults(self, since: float = 0.0, fatal_only: bool = True) -> list[GpuFault]:
        with self._lock:
            return [f for f in self._faults if f.time >= since and (f.fatal or not fatal_only)]

    def _add(self, faults: list[GpuFault]) -> None:
        for f in faults:
            (log.error if f.fatal else log.warning)("GPU fault: %s", f.detail)
        with self._lock:
            self._faults.extend(faults)

    def _ecc_count(self, h: int) -> int | None:
        n = self.nvml
        try:
            return int(n.device_get_total_ecc_errors(
                h, int(n.MemoryErrorType.UNCORRECTED), int(n.EccCounterType.VOLATILE_ECC)))
        except n.NvmlError:
            return None  # ECC off or not supported on this device

    def _watch(self) -> None:
        n = self.nvml
        while not self._stop.is_set():
            try:
                ev = n.event_set_wait_v2(self._set, int(self.poll_s * 1000))
            except n.TimeoutError:
                ev = None
            except n.NvmlError as e:
                log.warning("NVML event wait failed (%s); polling ECC counts only", e)
                ev = None
                self._stop.wait(self.poll_s)
            now = time.time()
            if ev is not None:
                self._add([self._event_fault(ev, now)])
            for h, uuid in self._handles.items():
                count = self._ecc_count(h)
                self._add(ecc_faults(uuid, self._ecc.get(uuid), count, now))
                if count is not None:
                    with self._lock:
                        self._ecc[uuid] = count

    def _event_fault(self, ev: Any, now: float) -> GpuFault:
        n = self.nvml
        uuid = self._handles.get(int(ev.device_), "unknown")
        if int(ev.event_type) == int(n.EventType.XID_CRITICAL_ERROR):
            xid = int(ev.event_data)
            return GpuFault(uuid, "xid", xid, now, fatal_xid(xid), f"XID {xid} on GPU {uuid}")
        return GpuFault(uuid, "ecc", 1, now, True, f"double-bit ECC error on GPU {uuid}")


def detect(poll_s: float = 1.0) -> GpuHealth | None:
    """This node's GPU watcher, or None without NVML (no driver, no GPU): one log line."""
    try:
        from cuda.bindings import nvml
    except ImportError as e:
        log.info("GPU health off: cuda.bindings.nvml is not importable (%s)", e)
        return None
    try:
        health = GpuHealth(nvml, poll_s)
        if not health.start()._handles:
            health.stop()
            log.info("GPU health off: NVML sees no GPU")
            return None
        return health
    except Exception as e:  # noqa: BLE001 - any way of not having NVML means: no watcher
        log.info("GPU health off: %s", e)
        return None
