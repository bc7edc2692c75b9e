"""A stand-in for `cuda.bindings.nvml` (the calls snapshotter/gpu/health.py makes), for machines
without a GPU. Same function names and the real enums (cuda-python imports without a driver);
its own exception classes with the real names, since the real ones need the library to be
built. It enforces NVML's rules as documented:

    any call before init_v2, or after the last shutdown   UninitializedError
    a device index past the count, an unknown handle      InvalidArgumentError
    an unknown or freed event set                         InvalidArgumentError
    events a device does not support                      NotSupportedError (nothing registered)
    no event within the wait's timeout                    TimeoutError
    ECC counts on a device with ECC off                   NotSupportedError

Faults: `xid(index, code)` and `double_bit(index)` deliver an event to every set the device
registered that type with; `ecc(index, n)` adds to its volatile uncorrected ECC count.
Test-only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from cuda.bindings import nvml as _real

EventType = _real.EventType
MemoryErrorType = _real.MemoryErrorType
EccCounterType = _real.EccCounterType


class NvmlError(Exception):
    pass


class UninitializedError(NvmlError):
    pass


class InvalidArgumentError(NvmlError):
    pass


class NotSupportedError(NvmlError):
    pass


class TimeoutError(NvmlError):  # noqa: A001 - NVML's own name, as cuda.bindings.nvml has it
    pass


@dataclass(frozen=True)
class EventData:
    device_: int
    event_type: int
    event_data: int


@dataclass
class FakeDevice:
    uuid: str
    ecc_enabled: bool = True
    supported_events: int = int(EventType.XID_CRITICAL_ERROR) | int(
        EventType.DOUBLE_BIT_ECC_ERROR
    )
    uncorrected: int = 0


@dataclass
class _Set:
    registered: dict[int, int] = field(default_factory=dict)  # handle -> event mask
    pending: list[EventData] = field(default_factory=list)


class FakeNvml:
    EventType = EventType
    MemoryErrorType = MemoryErrorType
    EccCounterType = EccCounterType
    NvmlError = NvmlError
    UninitializedError = UninitializedError
    InvalidArgumentError = InvalidArgumentError
    NotSupportedError = NotSupportedError
    TimeoutError = TimeoutError

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        self._inits = 0
        self._sets: dict[int, _Set] = {}
        self._next_set = 1
        self._cv = threading.Condition()

    # ---- the NVML surface ------------------------------------------------------------------

    def init_v2(self) -> None:
        with self._cv:
            self._inits += 1

    def shutdown(self) -> None:
        with self._cv:
            self._ready()
            self._inits -= 1

    def device_get_count_v2(self) -> int:
        with self._cv:
            self._ready()
            return len(self.devices)

    def device_get_handle_by_index_v2(self, index: int) -> int:
        with self._cv:
            self._ready()
            if not 0 <= index < len(self.devices):
                raise InvalidArgumentError(f"device index {index}")
            return 0x1000 + index

    def device_get_uuid(self, handle: int) -> str:
        with self._cv:
            return self._device(handle).uuid

    def device_get_total_ecc_errors(self, handle: int, error_type: int, counter: int) -> int:
        with self._cv:
            d = self._device(handle)
            if not d.ecc_enabled:
                raise NotSupportedError("ECC is off")
            if error_type != int(MemoryErrorType.UNCORRECTED):
                return 0
            return d.uncorrected

    def event_set_create(self) -> int:
        with self._cv:
            self._ready()
            sid = self._next_set
            self._next_set += 1
            self._sets[sid] = _Set()
            return sid

    def event_set_free(self, sid: int) -> None:
        with self._cv:
            self._set(sid)
            del self._sets[sid]
            self._cv.notify_all()

    def device_register_events(self, handle: int, mask: int, sid: int) -> None:
        with self._cv:
            d = self._device(handle)
            s = self._set(sid)
            if mask & ~d.supported_events:
                raise NotSupportedError(f"events {mask:#x} on {d.uuid}")
            s.registered[handle] = s.registered.get(handle, 0) | mask

    def event_set_wait_v2(self, sid: int, timeout_ms: int) -> EventData:
        with self._cv:
            s = self._set(sid)
            if not self._cv.wait_for(lambda: bool(s.pending) or sid not in self._sets,
                                     timeout_ms / 1000):  # fmt: skip
                raise TimeoutError(f"no event within {timeout_ms} ms")
            self._set(sid)
            return s.pending.pop(0)

    # ---- faults ----------------------------------------------------------------------------

    def xid(self, index: int, code: int) -> None:
        self._deliver(index, int(EventType.XID_CRITICAL_ERROR), code)

    def double_bit(self, index: int) -> None:
        self.devices[index].uncorrected += 1
        self._deliver(index, int(EventType.DOUBLE_BIT_ECC_ERROR), 0)

    def ecc(self, index: int, n: int) -> None:
        with self._cv:
            self.devices[index].uncorrected += n

    # ---- state -----------------------------------------------------------------------------

    def _deliver(self, index: int, etype: int, data: int) -> None:
        handle = 0x1000 + index
        with self._cv:
            for s in self._sets.values():
                if s.registered.get(handle, 0) & etype:
                    s.pending.append(EventData(handle, etype, data))
            self._cv.notify_all()

    def _ready(self) -> None:
        if self._inits <= 0:
            raise UninitializedError("call init_v2 first")

    def _device(self, handle: int) -> FakeDevice:
        self._ready()
        index = handle - 0x1000
        if not 0 <= index < len(self.devices):
            raise InvalidArgumentError(f"unknown device handle {handle:#x}")
        return self.devices[index]

    def _set(self, sid: int) -> _Set:
        self._ready()
        s = self._sets.get(sid)
        if s is None:
            raise InvalidArgumentError(f"unknown event set {sid}")
        return s
