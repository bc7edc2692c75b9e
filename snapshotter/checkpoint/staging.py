"""The rank's one copy: a state dict staged into shared memory the uploader reads directly.

Each slot is a memfd (named `snapshotter-ckpt-slot`), mapped into the rank and sized to the
state; staging copies every tensor into it, each on its own page, and hands DCP a state dict
whose tensors are views of that memory. The uploader (the node agent, or a child process)
reads the bytes straight from the memfd, so staging is the only copy the training loop pays.

Two slots by default: a save stages into the free one while the previous save still uploads
from the other (double buffering); a third save waits until a slot is released, which bounds
memory at two copies of the state. Where CUDA is present the slots are registered as pinned
memory, so device-to-host copies run at full speed.

Slots stay mapped between saves (a fresh mapping would cost page faults on every save): a
process snapshot of the rank carries them, as CRIU dumps a memfd's contents. `close()` (the
writer's, or the end of the job) releases them.
"""

from __future__ import annotations

import copy
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from snapshotter.checkpoint import catalog
from snapshotter.checkpoint.spool import MEMFD_NAME

log = logging.getLogger(__name__)


class Slot:
    """One memfd-backed staging buffer. BUSY from `stage` until the upload that reads it is
    done (`Stager.release`)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.fd = os.memfd_create(f"{MEMFD_NAME}-slot{index}", os.MFD_CLOEXEC)
        self.size = 0
        self.base = 0
        self.buf: torch.Tensor | None = None
        self._pinned = False
        self.busy = False

    def ensure(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.size or self.buf is None:
            self._unpin()
            size = catalog.aligned(max(nbytes, 1) + nbytes // 8)  # room to grow a little
            os.ftruncate(self.fd, size)
            mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            # The tensor holds the mapping: views handed out earlier keep the old one alive.
            self.buf = torch.frombuffer(mm, dtype=torch.uint8)
            self.size, self.base = size, self.buf.data_ptr()
            self._pin()
        return self.buf

    def holds(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and self.base <= t.data_ptr() < self.base + self.size

    def _pin(self) -> None:
        if not torch.cuda.is_available() or self.buf is None:
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
        self._pinned = int(rc) == 0
        if not self._pinned:
            log.warning("could not pin checkpoint staging memory (cudaHostRegister %s)", rc)

    def _unpin(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self._pinned = False

    def close(self) -> None:
        self._unpin()
        self.buf = None
        os.close(self.fd)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own bytes of a tensor (a DTensor's local shard)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def _leaves(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(local_tensor(obj))
    elif isinstance(obj, dict):
        for v in obj.values():
            _leaves(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _leaves(v, out)


class Stager:
    """The slots of one writer, and the copy into them."""

    def __init__(self, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError("a stager needs at least one slot")
        self._slots = [Slot(i) for i in range(slots)]
        self._cond = threading.Condition()
        self._order: list[Slot] = []  # busy slots, oldest first

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` whose tensors live in a free slot (waits for one)."""
        tensors: list[torch.Tensor] = []
        _leaves(state_dict, tensors)
        lengths = [t.numel() * t.element_size() for t in tensors]
        offsets = catalog.layout(lengths)
        total = (offsets[-1] + lengths[-1]) if tensors else 0
        slot = self._acquire()
        try:
            buf = slot.ensure(total)
            where = {id(t): (o, n) for t, o, n in zip(tensors, offsets, lengths, strict=True)}
            staged = _copy(state_dict, lambda t: _into(buf, t, *where[id(local_tensor(t))]))
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies were non-blocking
            return staged
        except BaseException:
            self.release(slot)
            raise

    def slot_of(self, tensors: list[torch.Tensor]) -> Slot | None:
        with self._cond:
            for t in tensors:
                for s in self._slots:
                    if s.busy and s.holds(t):
                        return s
            return None

    def oldest_busy(self) -> Slot | None:
        with self._cond:
            return self._order[0] if self._order else None

    def _acquire(self) -> Slot:
        with self._cond:
            while True:
                for s in self._slots:
                    if not s.busy:
                        s.busy = True
                        self._order.append(s)
                        return s
                self._cond.wait()

    def release(self, slot: Slot) -> None:
        with self._cond:
            if slot.busy:
                slot.busy = False
                self._order.remove(slot)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            for s in self._slots:
                s.close()
            self._slots = []


def _into(buf: torch.Tensor, t: torch.Tensor, offset: int, length: int) -> torch.Tensor:
    src = local_tensor(t)
    view = buf[offset:offset + length].view(src.dtype).view(src.shape)
    view.copy_(src.detach(), non_blocking=src.device.type == "cuda")
    if src is t:
        return view
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor)
    return DTensor.from_local(view, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())  # fmt: skip


def _copy(obj: Any, tensor: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by `tensor(t)` and everything else deep-copied, so
    that nothing training changes after staging reaches the checkpoint."""
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _copy(v, tensor)) for k, v in obj.items())  # OrderedDict stays one
    if isinstance(obj, list):
        return [_copy(v, tensor) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_copy(v, tensor) for v in obj)
    return copy.deepcopy(obj)
