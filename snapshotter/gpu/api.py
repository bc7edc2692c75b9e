"""The boundary between snapshotter and a GPU checkpoint driver, and the types it speaks.

A driver moves one process's GPU state into that process's host memory and back (NVIDIA's
checkpoint driver API, `cuCheckpointProcess*`). It never touches CRIU, sockets or the rank's
control channel: ordering those around it is the GPU stage's job (`snapshotter.gpu.stage`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass


class ProcessState(enum.Enum):
    """A CUDA process's checkpoint state, as the driver reports it (values of CUprocessState).

    ::

        RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED
           ^                |  ^                     |
           +-----unlock-----+  +------restore--------+

    A lock that times out leaves the process RUNNING. CHECKPOINTING and RESTORING are seen
    only while another caller's checkpoint or restore is in flight; FAILED is terminal.
    """

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4
    RESTORING = 5


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as the snapshot records it: enough to find an equivalent one elsewhere."""

    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it
    name: str  # the chip, e.g. "NVIDIA H200": restore needs the same type
    memory: int  # total bytes

    def to_dict(self) -> dict[str, object]:
        return {"uuid": self.uuid, "name": self.name, "memory": self.memory}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> GpuInfo:
        return cls(uuid=str(d["uuid"]), name=str(d["name"]), memory=int(str(d["memory"])))


def uuid_str(raw: bytes) -> str:
    """The nvidia-smi spelling of a 16-byte CUuuid."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def uuid_bytes(text: str) -> bytes:
    """Inverse of `uuid_str` (accepts the text with or without the "GPU-" prefix)."""
    t = text.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(t)
    if len(raw) != 16:
        raise ValueError(f"not a GPU UUID: {text!r}")
    return raw


class CheckpointDriver(abc.ABC):
    """Checkpoints and restores the GPU state of a process, identified by its host pid.

    Every call is synchronous. Errors are `GpuDriverError` carrying the CUresult name; a
    process without CUDA state answers `get_state` with a `GpuDriverError` whose `result` is
    one of `NO_CUDA_RESULTS`.
    """

    @abc.abstractmethod
    def get_state(self, pid: int) -> ProcessState:
        """The process's checkpoint state.

        Raises:
            GpuDriverError: unknown pid, no CUDA state in it, driver not initialised.
        """

    @abc.abstractmethod
    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED: block further CUDA calls and wait for work in flight.

        Raises:
            GpuLockTimeout: not locked within `timeout_ms`; the process is still RUNNING.
            GpuDriverError: not RUNNING (CUDA_ERROR_ILLEGAL_STATE), unknown pid, ...
        """

    @abc.abstractmethod
    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: GPU memory moved to host memory, device references dropped.

        Raises:
            GpuDriverError: not LOCKED, unknown pid, out of host memory, ...
        """

    @abc.abstractmethod
    def restore(self, pid: int, gpu_pairs: Sequence[tuple[str, str]] | None = None) -> None:
        """CHECKPOINTED -> LOCKED, onto the same GPUs or per (old uuid, new uuid) pairs, which
        must then name every GPU the process was checkpointed on.

        Raises:
            GpuDriverError: not CHECKPOINTED, a GPU missing or of another type, ...
        """

    @abc.abstractmethod
    def unlock(self, pid: int) -> None:
        """LOCKED -> RUNNING.

        Raises:
            GpuDriverError: not LOCKED, unknown pid, ...
        """

    @abc.abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """The GPUs this node's driver sees, in CUDA ordinal order.

        Raises:
            GpuDriverError: the driver could not enumerate them.
        """

    def process_gpus(self, pid: int) -> list[GpuInfo] | None:
        """The GPUs `pid` holds open, or None when this driver cannot tell (then the stage
        records every GPU of the node). Never raises."""
        return None


# CUresult names meaning "this process has no CUDA state to checkpoint": the stage skips it.
NO_CUDA_RESULTS = frozenset(
    {"CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_INVALID_VALUE"}
)
# CUresult names a lock that ran out of time comes back with.
LOCK_TIMEOUT_RESULTS = frozenset({"CUDA_ERROR_TIMEOUT", "CUDA_ERROR_NOT_READY"})
