"""A stand-in for `cuda.bindings.driver` at the checkpoint boundary, for machines without a GPU.

Same function names, same return tuples `(CUresult, ...)`, the real enum and struct types
(imported from cuda-python, which imports without a driver). It enforces the driver's state
machine per pid and answers misuse with the codes the real driver documents:

    no cuInit(0) yet                      CUDA_ERROR_NOT_INITIALIZED
    pid not alive                         CUDA_ERROR_INVALID_VALUE
    alive, but no CUDA state (not added)  CUDA_ERROR_NOT_FOUND
    wrong state for the call              CUDA_ERROR_ILLEGAL_STATE
    lock not done within timeoutMs        CUDA_ERROR_TIMEOUT (process stays RUNNING)
    restore pairs missing a GPU / unknown
    or different GPU                      CUDA_ERROR_INVALID_VALUE

A process gets CUDA state with `add_process(pid, devices)`. Faults: `fail(op, result, pid)`
makes the next matching call fail (the state does not change, as for a real failed call),
`busy(pid)` makes locks of that pid wait for in-flight work that never finishes, and
`delay[op]` makes every call of op take that many seconds (to see parallelism).

Test-only: it never touches the processes it is told about.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import cuda.bindings.driver as _real

from snapshotter.procutil import pid_alive

CUresult = _real.CUresult
CUprocessState = _real.CUprocessState
CUcheckpointLockArgs = _real.CUcheckpointLockArgs
CUcheckpointCheckpointArgs = _real.CUcheckpointCheckpointArgs
CUcheckpointRestoreArgs = _real.CUcheckpointRestoreArgs
CUcheckpointUnlockArgs = _real.CUcheckpointUnlockArgs
CUcheckpointGpuPair = _real.CUcheckpointGpuPair
CUuuid = _real.CUuuid
CUdevice = _real.CUdevice

_S = CUprocessState
_OK = CUresult.CUDA_SUCCESS


@dataclass
class FakeGpu:
    uuid: bytes
    name: str = "NVIDIA H200"
    memory: int = 143_771_287_552


@dataclass
class _Proc:
    state: Any
    devices: list[FakeGpu]
    busy: bool = False
    history: list[str] = field(default_factory=list)


class FakeCudaDriver:
    """One fake node: its GPUs and the CUDA processes the tests declared."""

    CUresult = CUresult
    CUprocessState = CUprocessState
    CUcheckpointLockArgs = CUcheckpointLockArgs
    CUcheckpointCheckpointArgs = CUcheckpointCheckpointArgs
    CUcheckpointRestoreArgs = CUcheckpointRestoreArgs
    CUcheckpointUnlockArgs = CUcheckpointUnlockArgs
    CUcheckpointGpuPair = CUcheckpointGpuPair
    CUuuid = CUuuid
    CUdevice = CUdevice

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(bytes([0xA0] + [0] * 14 + [1]))]
        self.initialized = False
        self.delay: dict[str, float] = {}
        self.calls: list[tuple[str, int, str]] = []  # (op, pid, result name)
        self._procs: dict[int, _Proc] = {}
        self._faults: list[tuple[str, Any, int | None]] = []
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    # ---- test controls -------------------------------------------------------------------

    def add_process(
        self, pid: int, devices: list[int | FakeGpu] | None = None, state: Any = None
    ) -> None:
        """Give `pid` CUDA state on these GPUs (ordinals of this node, or FakeGpu objects of
        another node for a process restored here from elsewhere)."""
        devs = [self.gpus[d] if isinstance(d, int) else d for d in (devices or [0])]
        with self._lock:
            self._procs[pid] = _Proc(state if state is not None else _S.CU_PROCESS_STATE_RUNNING,
                                     devs)

    def state_of(self, pid: int) -> Any:
        with self._lock:
            return self._procs[pid].state

    def devices_of(self, pid: int) -> list[bytes]:
        with self._lock:
            return [g.uuid for g in self._procs[pid].devices]

    def fail(self, op: str, result: Any, pid: int | None = None) -> None:
        with self._lock:
            self._faults.append((op, result, pid))

    def busy(self, pid: int, value: bool = True) -> None:
        with self._lock:
            self._procs[pid].busy = value

    # ---- the cuda.bindings.driver surface ------------------------------------------------

    def cuInit(self, flags: int) -> tuple[Any]:  # noqa: N802 - cuda-python's names
        self.initialized = True
        return (_OK,)

    def cuGetErrorName(self, error: Any) -> tuple[Any, bytes]:  # noqa: N802
        return (_OK, CUresult(error).name.encode())

    def cuDeviceGetCount(self) -> tuple[Any, int]:  # noqa: N802
        if not self.initialized:
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)
        return (_OK, len(self.gpus))

    def cuDeviceGet(self, ordinal: int) -> tuple[Any, Any]:  # noqa: N802
        if not self.initialized:
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
        if not 0 <= ordinal < len(self.gpus):
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        return (_OK, CUdevice(ordinal))

    def _dev(self, dev: Any) -> FakeGpu | None:
        i = int(dev)
        return self.gpus[i] if self.initialized and 0 <= i < len(self.gpus) else None

    def cuDeviceGetUuid(self, dev: Any) -> tuple[Any, Any]:  # noqa: N802
        g = self._dev(dev)
        if g is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, None)
        u = CUuuid()
        import ctypes

        ctypes.memmove(u.getPtr(), g.uuid, 16)
        return (_OK, u)

    def cuDeviceGetName(self, length: int, dev: Any) -> tuple[Any, bytes]:  # noqa: N802
        g = self._dev(dev)
        if g is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, b"")
        return (_OK, g.name.encode()[: length - 1] + b"\0")

    def cuDeviceTotalMem(self, dev: Any) -> tuple[Any, int]:  # noqa: N802
        g = self._dev(dev)
        if g is None:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, 0)
        return (_OK, g.memory)

    def cuCheckpointProcessGetState(self, pid: int) -> tuple[Any, Any]:  # noqa: N802
        with self._lock:
            res, p = self._common("get_state", pid)
            return (res, p.state if p is not None and res == _OK else _S.CU_PROCESS_STATE_FAILED)

    def cuCheckpointProcessLock(self, pid: int, args: Any) -> tuple[Any]:  # noqa: N802
        timeout_ms = int(args.timeoutMs) if args is not None else 0
        with self._lock:
            res, p = self._common("lock", pid, need=_S.CU_PROCESS_STATE_RUNNING)
            busy = p is not None and p.busy
        if res != _OK or p is None:
            return (res,)
        self._enter()
        try:
            self._sleep("lock")
            if busy:
                # Waits for work in flight that never completes: only the timeout ends it.
                if timeout_ms == 0:
                    while True:
                        with self._lock:
                            if not p.busy:
                                break
                        time.sleep(0.01)
                else:
                    time.sleep(timeout_ms / 1000)
                    with self._lock:
                        if p.busy:
                            return self._log("lock", pid, CUresult.CUDA_ERROR_TIMEOUT)
            with self._lock:
                p.state = _S.CU_PROCESS_STATE_LOCKED
                return self._log("lock", pid, _OK)
        finally:
            self._leave()

    def cuCheckpointProcessCheckpoint(self, pid: int, args: Any) -> tuple[Any]:  # noqa: N802
        return self._move("checkpoint", pid, _S.CU_PROCESS_STATE_LOCKED,
                          _S.CU_PROCESS_STATE_CHECKPOINTED)

    def cuCheckpointProcessRestore(self, pid: int, args: Any) -> tuple[Any]:  # noqa: N802
        pairs: list[tuple[bytes, bytes]] = []
        if args is not None and int(args.gpuPairsCount):
            given = args.gpuPairs
            given = given if isinstance(given, list) else [given]
            pairs = [(bytes(p.oldUuid.bytes), bytes(p.newUuid.bytes)) for p in given]
            if len(pairs) != int(args.gpuPairsCount):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        with self._lock:
            p = self._procs.get(pid)
            here = {g.uuid for g in self.gpus}
            if p is not None and not pairs and any(d.uuid not in here for d in p.devices):
                # Checkpointed on GPUs this node does not have, and no pairs to remap them.
                return self._log("restore", pid, CUresult.CUDA_ERROR_INVALID_DEVICE)
            if p is not None and pairs:
                mapping = dict(pairs)
                node = {g.uuid: g for g in self.gpus}
                ok = all(
                    d.uuid in mapping
                    and mapping[d.uuid] in node
                    and node[mapping[d.uuid]].name == d.name
                    and node[mapping[d.uuid]].memory >= d.memory
                    for d in p.devices
                )
                if not ok:
                    return self._log("restore", pid, CUresult.CUDA_ERROR_INVALID_VALUE)
        res = self._move("restore", pid, _S.CU_PROCESS_STATE_CHECKPOINTED,
                         _S.CU_PROCESS_STATE_LOCKED)
        if res[0] == _OK and pairs:
            with self._lock:
                p = self._procs[pid]
                node = {g.uuid: g for g in self.gpus}
                p.devices = [node[dict(pairs)[d.uuid]] for d in p.devices]
        return res

    def cuCheckpointProcessUnlock(self, pid: int, args: Any) -> tuple[Any]:  # noqa: N802
        return self._move("unlock", pid, _S.CU_PROCESS_STATE_LOCKED, _S.CU_PROCESS_STATE_RUNNING)

    # ---- internals -----------------------------------------------------------------------

    def _move(self, op: str, pid: int, need: Any, to: Any) -> tuple[Any]:
        with self._lock:
            res, p = self._common(op, pid, need=need)
        if res != _OK or p is None:
            return (res,)
        self._enter()
        try:
            self._sleep(op)
            with self._lock:
                if p.state != need:  # someone else moved it meanwhile
                    return self._log(op, pid, CUresult.CUDA_ERROR_ILLEGAL_STATE)
                p.state = to
                p.history.append(op)
                return self._log(op, pid, _OK)
        finally:
            self._leave()

    def _common(self, op: str, pid: int, need: Any = None) -> tuple[Any, _Proc | None]:
        """Checks every call shares, under self._lock; logs failures."""
        if not self.initialized:
            return self._log(op, pid, CUresult.CUDA_ERROR_NOT_INITIALIZED)[0], None
        if not isinstance(pid, int) or pid <= 0 or not pid_alive(pid):
            return self._log(op, pid, CUresult.CUDA_ERROR_INVALID_VALUE)[0], None
        p = self._procs.get(pid)
        if p is None:
            return self._log(op, pid, CUresult.CUDA_ERROR_NOT_FOUND)[0], None
        for i, (fop, fres, fpid) in enumerate(self._faults):
            if fop == op and (fpid is None or fpid == pid):
                del self._faults[i]
                return self._log(op, pid, fres)[0], None
        if need is not None and p.state != need:
            return self._log(op, pid, CUresult.CUDA_ERROR_ILLEGAL_STATE)[0], None
        if op == "get_state":
            self.calls.append((op, pid, "CUDA_SUCCESS"))
        return _OK, p

    def _log(self, op: str, pid: int, res: Any) -> tuple[Any]:
        self.calls.append((op, pid, CUresult(res).name))
        return (res,)

    def _sleep(self, op: str) -> None:
        d = self.delay.get(op, 0.0)
        if d:
            time.sleep(d)

    def _enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _leave(self) -> None:
        with self._lock:
            self.in_flight -= 1
