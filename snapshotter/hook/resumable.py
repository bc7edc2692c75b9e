"""Process groups whose real communicator can be torn down and rebuilt under a live handle.

What the script holds is a `ResumableProcessGroup`: a Python subclass of
`torch.distributed.ProcessGroup` that owns no communicator itself. Every collective and p2p call
is forwarded to an *inner* plain `ProcessGroup` with a real `ProcessGroupGloo` backend
registered on it (the pattern of torchft's reconfigurable process groups). The inner group can
be dropped (`teardown`, its sockets close with it) and replaced (`rebuild`); the handle the
script, DDP's Reducer and DeviceMesh hold never changes. Each call passes the quiesce barrier
first, which counts it and, during a freeze, parks it.

How the handle gets into the script without touching it (`install`):

* `distributed_c10d.ProcessGroupGloo` is replaced by a factory whose instances pass
  `isinstance(x, ProcessGroupGloo)`. `_new_process_group_helper` then takes its branch "if the
  type is a subclass of ProcessGroup then return this process group immediately", so the
  default group, every `new_group` and every DeviceMesh group is a ResumableProcessGroup, and
  `dist.get_backend()` still says "gloo".
* `_new_process_group_helper` is wrapped to learn each group's name (the GROUP_KEY: identical on
  all ranks, unlike a local creation index, which non-member ranks would skip).
* C++ callers reach the Python overrides through pybind's `PyProcessGroup` trampoline:
  `allreduce` (DDP's Reducer), `broadcast` (`_broadcast_coalesced`), `allgather`
  (`_verify_params_across_processes`), `barrier`, `send`/`recv`, the coalesced variants and
  `alltoall_base`. The outer group also carries a `FakeProcessGroup` backend created with
  `error_on_collective=True`, registered as GLOO, because DDP's logger and other C++ code look a
  backend up by type. A C++ path that skips the trampoline (e.g. functional
  `all_gather_into_tensor`, which calls the non-virtual-in-Python `_allgather_base`) lands on
  that backend and raises instead of silently doing nothing.

NCCL groups get the same treatment where torch has NCCL (`ResumableNcclGroup`, installed only
then, so CPU builds are unchanged): the inner backend is a real `ProcessGroupNCCL`; teardown
synchronizes the CUDA devices (no pending work), then shuts the communicator down; a rebuild
makes a new one, whose communicator NCCL creates lazily at the next collective, reading its
environment (NCCL_SOCKET_IFNAME, ...) as the agent set it for the new node.

Not resumable, and refused loudly: multi-backend groups ("cpu:gloo,cuda:nccl"),
`split_group`/`merge_remote_group`, the coalescing manager on the outer group.

Imports only stdlib and torch. Why one module of ~500 lines: the gloo and NCCL groups, their
factories and the registry share one set of torch internals (the pybind trampoline, the
helper wrap); split apart, each half would re-derive what the other patches.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import FakeProcessGroup

from snapshotter.hook import telemetry
from snapshotter.hook.barrier import channel
from snapshotter.hook.sockets import Owned
from snapshotter.hook.telemetry import Latencies

_REAL_GLOO: Any = c10d.ProcessGroupGloo
BACKEND_NAME = "snapshotter-gloo"
_GLOO = dist.ProcessGroup.BackendType.GLOO
_CUSTOM = dist.ProcessGroup.BackendType.CUSTOM
_REAL_NCCL: Any = getattr(c10d, "ProcessGroupNCCL", None)  # None in CPU-only torch builds
NCCL_BACKEND_NAME = "snapshotter-nccl"

# Every entry point of torch.distributed that issues a collective on a group (send, recv and
# recv_anysource are methods of their own: they count per channel).
COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "broadcast",
    "reduce",
    "allgather",
    "_allgather_base",
    "all_gather_single",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)

# Methods that would need a communicator we cannot rebuild; they fail with this message.
REFUSED = {
    "split_group": "split_group (communicator splitting)",
    "merge_remote_group": "merge_remote_group",
    "_start_coalescing": "the coalescing manager (_coalescing_manager / batch_isend_irecv)",
    "_end_coalescing": "the coalescing manager (_coalescing_manager / batch_isend_irecv)",
}


class NotResumable(RuntimeError):
    """The script used a torch.distributed feature that snapshotter cannot make resumable."""


@dataclass
class _Creating:
    group_name: str
    global_ranks: list[int]
    backend: str


_creating: contextvars.ContextVar[_Creating | None] = contextvars.ContextVar(
    "snapshotter_creating", default=None
)


@dataclass
class _Options:
    """Stands in for `ProcessGroupGloo.options`, which the helper writes to."""

    global_ranks_in_group: list[int] = field(default_factory=list)
    group_name: str = ""
    _timeout: timedelta = timedelta(minutes=30)


def _devices() -> list[torch.device]:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available():
        devs.append(torch.device("cuda"))
    return devs


def _real_gloo(
    store: dist.Store, rank: int, size: int, timeout: timedelta, ranks: list[int], key: str
) -> Any:
    """The real gloo backend of one group, named and ranked as torch's helper would."""
    backend = _REAL_GLOO(store, rank, size, timeout=timeout)
    backend.options.global_ranks_in_group = ranks
    backend.options.group_name = key
    return backend


class ResumableProcessGroup(dist.ProcessGroup):
    """The handle a script holds; forwards to a rebuildable inner gloo group."""

    _backend_type = _GLOO
    _backend_name = BACKEND_NAME

    def __init__(
        self,
        registry: GroupRegistry,
        key: str,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        global_ranks: list[int],
    ) -> None:
        init: Any = super().__init__
        init(rank, size)  # only (rank, size) builds pybind's trampoline instance
        self._registry = registry
        self._key = key
        self._timeout = timeout
        self._global_ranks = list(global_ranks)
        self._inner: Any = None
        self._inner_lock = threading.Lock()
        self.options = _Options(list(global_ranks), key, timeout)
        self._set_default_backend(self._backend_type)
        fake_opts: Any = FakeProcessGroup.Options()  # type: ignore[call-arg]
        fake_opts.error_on_collective = True
        # Keep the fake alive on the Python side too: the C++ map holds only its C++ half.
        create: Any = FakeProcessGroup._create_internal
        self._fake = create(rank, size, fake_opts)
        for dev in self._backend_devices():
            self._register_backend(dev, self._backend_type, self._fake)

    @property
    def key(self) -> str:
        return self._key

    def getBackendName(self) -> str:  # noqa: N802 (the C++ name the trampoline looks up)
        # C++ code that sees "gloo" static_casts the registered backend to ProcessGroupGloo
        # (DDP's Logger reads its thread count); ours is a FakeProcessGroup, so never say "gloo"
        # there. Python's dist.get_backend() reads torch's own table and still says "gloo".
        return self._backend_name

    def _backend_devices(self) -> list[torch.device]:
        return _devices()

    def _make_backend(self, store: dist.Store) -> Any:
        return _real_gloo(store, self.rank(), self.size(), self._timeout, self._global_ranks,
                          self._key)  # fmt: skip

    # ---- communicator lifecycle ----------------------------------------------------------

    def _build(self, store: dist.Store) -> None:
        owned = self._registry.owned
        with owned.track():
            backend = self._make_backend(store)
            backend._set_sequence_number_for_group()
        inner = dist.ProcessGroup(store, self.rank(), self.size())
        inner._set_default_backend(self._backend_type)
        for dev in self._backend_devices():
            inner._register_backend(dev, self._backend_type, backend)
        with self._inner_lock:
            self._inner = inner

    def _teardown(self) -> None:
        with self._inner_lock:
            self._inner = None

    def _current(self) -> Any:
        inner = self._inner
        if inner is None:
            raise RuntimeError(
                f"snapshotter: process group {self._key!r} has no communicator "
                "(torn down for a freeze, or destroyed)"
            )
        return inner

    # ---- forwarding ----------------------------------------------------------------------

    def _issue(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._issue_on(self._key, name, args, kwargs)

    def _issue_on(self, key: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        registry = self._registry
        seq = registry.barrier.enter(key)
        issued = time.monotonic()
        work = getattr(self._current(), name)(*args, **kwargs)
        if work is None:  # synchronous (monitored_barrier)
            return work
        lat = registry.latencies
        handle = _Handle(work, None if lat is None else (lat, key, seq, issued))
        registry.handles.add(handle)
        registry.barrier.track(handle)
        return handle

    # Point-to-point ops count per channel (peer and direction), not with the collectives:
    # how many a rank issues on a group differs from its peers'.
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        key = channel(self._key, self.rank(), dst)
        return self._issue_on(key, "send", (tensors, dst, tag), {})

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        key = channel(self._key, src, self.rank())
        return self._issue_on(key, "recv", (tensors, src, tag), {})

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise NotResumable(
            "snapshotter: recv from any source is not supported on a resumable process group "
            "(a freeze could not tell which peer's message it is); name the source rank"
        )

    def _set_sequence_number_for_group(self) -> None:
        pass  # the inner backend got its own when it was built

    def _get_sequence_number_for_group(self) -> int:
        return self._current()._get_sequence_number_for_group()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        inner = self._inner
        if inner is not None:
            inner.set_timeout(timeout)

    def shutdown(self) -> None:
        self._registry.forget(self)
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.shutdown()

    def abort(self) -> None:
        self._registry.forget(self)
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.abort()


def _forwarder(name: str) -> Callable[..., Any]:
    def method(self: ResumableProcessGroup, *args: Any, **kwargs: Any) -> Any:
        return self._issue(name, args, kwargs)

    method.__name__ = name
    return method


def _refuser(name: str, what: str) -> Callable[..., Any]:
    def method(self: ResumableProcessGroup, *args: Any, **kwargs: Any) -> Any:
        raise NotResumable(
            f"snapshotter: {what} is not supported on a resumable process group; "
            "run without snapshotter or avoid it"
        )

    method.__name__ = name
    return method


for _name in COLLECTIVES:
    setattr(ResumableProcessGroup, _name, _forwarder(_name))
for _name, _what in REFUSED.items():
    setattr(ResumableProcessGroup, _name, _refuser(_name, _what))


class _Handle(dist.Work):
    """What an op returns to its caller (the script, DDP's Reducer): the real work, until the
    communicator is torn down.

    A caller may keep a work long after it finished (DDP keeps its unused-parameter allreduce
    until the next step; scripts keep handles in lists), and a gloo work pins its context and
    with it every socket of the communicator. `release` (at teardown, once nothing is in
    flight) drops the real work and keeps its outcome, so the sockets close under any handle.

    Some works report completion only to a waiter: they have no future and `is_completed`
    stays false (gloo's send, recv and reduce_scatter). For those, `settle` (the barrier's
    parker) and `wait` (the caller) share one wait under a lock: a second wait could block
    for a message that never comes.
    """

    def __init__(
        self, work: Any, timing: tuple[Latencies, str, int, float] | None = None
    ) -> None:
        super().__init__()
        self._work: Any = work
        # Where to record this op's latency once the rank first sees it done (telemetry.py).
        self._timing = timing
        try:
            self._future: Any = work.get_future()
            self._lock: threading.Lock | None = None
        except RuntimeError:
            self._future = None
            self._lock = threading.Lock()
        self._waited = False
        self._ok = True
        self._error: BaseException | None = None

    # ---- the barrier's side (Pending) --------------------------------------------------------

    def done(self) -> bool:
        return self.is_completed()

    def _stamp(self) -> None:
        timing, self._timing = self._timing, None
        if timing is not None:
            lat, key, seq, issued = timing
            lat.record(key, seq, time.monotonic() - issued)

    def settle(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(Exception):  # the caller's wait raises it again
                self.wait()
        else:
            time.sleep(0.001)

    def release(self) -> None:
        work = self._work
        if work is None:
            return
        future = self._future
        if future is not None and future.done():
            # Work.result(), is_success() and exception() are deprecated (and say so in the
            # job's log): the outcome is the future's.
            try:
                future.value()
            except Exception:  # noqa: BLE001 - the op failed; the caller sees it on wait
                self._ok = False
        self._work = None

    # ---- dist.Work ---------------------------------------------------------------------------

    def wait(self, timeout: timedelta | None = None) -> bool:
        lock = self._lock
        if lock is None:
            work = self._work
            if work is None:
                return self._ok
            ok = bool(work.wait() if timeout is None else work.wait(timeout))
            self._waited = True
            self._stamp()
            return ok
        with lock:
            if not self._waited:
                try:
                    work = self._work
                    if work is not None:
                        self._ok = bool(work.wait() if timeout is None else work.wait(timeout))
                except BaseException as e:
                    self._ok, self._error = False, e
                self._waited = True
                self._stamp()
            if self._error is not None:
                raise self._error
            return self._ok

    def is_completed(self) -> bool:
        if self._waited or self._work is None:
            return True
        if self._lock is None and bool(self._work.is_completed()):
            self._stamp()
            return True
        return False

    def is_success(self) -> bool:
        work = self._work
        if work is None or self._lock is not None:
            return self._ok
        return bool(work.is_success())

    def exception(self) -> Any:
        work = self._work
        if work is None or self._lock is not None:
            return self._error
        return work.exception()

    def get_future(self) -> Any:
        if self._future is None:
            raise RuntimeError("Work::getFuture not implemented for this work")
        return self._future

    def result(self) -> Any:
        work = self._work
        if work is not None:
            return work.result()
        future = self._future
        return future.value() if future is not None and future.done() else None

    def synchronize(self) -> None:
        work = self._work
        if work is not None:
            work.synchronize()

    def source_rank(self) -> int:
        work = self._work
        if work is None:
            raise RuntimeError("snapshotter: source_rank() read after the communicator was rebuilt")
        return int(work._source_rank())


class NativeGlooGroup:
    """A gloo group on the native path (csrc/gate.cpp): torch's own ProcessGroup holds a
    `CountingBackend`, which counts every op on the native gate and forwards it to the real
    gloo backend this record builds and drops. Nothing of it runs in Python between freezes."""

    def __init__(
        self,
        registry: GroupRegistry,
        key: str,
        rank: int,
        size: int,
        timeout: timedelta,
        global_ranks: list[int],
    ) -> None:
        self._registry = registry
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._global_ranks = list(global_ranks)
        native: Any = registry.native
        self.backend: Any = native.CountingBackend(
            rank, size, registry.barrier.gate, key, BACKEND_NAME
        )
        # torch's helper writes the group's ranks and name here, as on a ProcessGroupGloo.
        self.backend.options = _Options(list(global_ranks), key, timeout)

    @property
    def key(self) -> str:
        return str(self.backend.key)

    def destroyed(self) -> bool:
        return bool(self.backend.destroyed())

    def _build(self, store: dist.Store) -> None:
        with self._registry.owned.track():
            real = _real_gloo(store, self._rank, self._size, self._timeout, self._global_ranks,
                              self.key)  # fmt: skip
            real._set_sequence_number_for_group()
        self.backend.set_inner(real)

    def _teardown(self) -> None:
        self.backend.clear_inner()

    @staticmethod
    def settle_registration(pg: Any, backend: Any) -> None:
        """Make the group's own name "custom", not "gloo": C++ code that sees "gloo" casts
        the registered backend to ProcessGroupGloo (DDP's Logger reads its thread count), and
        ours is a CountingBackend. dist.get_backend() reads torch's own table: still "gloo"."""
        for device in list(pg._device_types):
            pg._register_backend(torch.device(device), _CUSTOM, backend)
        pg._set_default_backend(_CUSTOM)


class GroupRegistry:
    """Every resumable group of this rank, in creation order, and what tears them down.

    With `barrier` a NativeBarrier (snapshotter/hook/native.py), gloo groups take the native
    path (NativeGlooGroup); NCCL groups, and every group without it, the Python one."""

    def __init__(self, barrier: Any, owned: Owned) -> None:
        self.barrier = barrier
        self.owned = owned
        self.native: Any = getattr(barrier, "ext", None)
        self._lock = threading.Lock()
        self._groups: list[ResumableProcessGroup | NativeGlooGroup] = []
        # Every work handed out and still referenced; released at teardown (see _Handle).
        self.handles: weakref.WeakSet[_Handle] = weakref.WeakSet()
        # The native backend made for the group torch's helper is creating (by group name).
        self.made: dict[str, Any] = {}
        # Python-path ops' latencies (native ops record in the gate); None: the record is off.
        self.latencies: Latencies | None = Latencies() if telemetry.enabled() else None

    def native_types(self) -> tuple[type, ...]:
        return () if self.native is None else (self.native.CountingBackend,)

    def groups(self) -> list[ResumableProcessGroup | NativeGlooGroup]:
        with self._lock:
            # A native group destroyed by torch (destroy_process_group) left the gate itself.
            self._groups = [
                g for g in self._groups if not (isinstance(g, NativeGlooGroup) and g.destroyed())
            ]
            return list(self._groups)

    def create(
        self,
        ctx: _Creating,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: timedelta,
        nccl_options: Any = None,
    ) -> ResumableProcessGroup:
        if "," in ctx.backend or ":" in ctx.backend:
            raise NotResumable(
                f"snapshotter: multi-backend process groups ({ctx.backend!r}) are not resumable"
            )
        nccl = "nccl" in ctx.backend.lower()
        pg: ResumableProcessGroup | NativeGlooGroup
        if self.native is not None and not nccl:
            pg = NativeGlooGroup(self, ctx.group_name, rank, size, timeout, ctx.global_ranks)
        else:
            cls = ResumableNcclGroup if nccl else ResumableProcessGroup
            pg = cls(self, ctx.group_name, store, rank, size, timeout, ctx.global_ranks)
            if isinstance(pg, ResumableNcclGroup):
                pg.nccl_options = nccl_options
        pg._build(store)
        with self._lock:
            self._groups.append(pg)
        self.barrier.add_group(pg.key)
        if isinstance(pg, NativeGlooGroup):
            self.made[ctx.group_name] = pg.backend
            return pg.backend
        return pg

    def forget(self, pg: ResumableProcessGroup | NativeGlooGroup) -> None:
        with self._lock:
            if pg in self._groups:
                self._groups.remove(pg)
        self.barrier.remove_group(pg.key)
        if self.latencies is not None:
            self.latencies.forget(pg.key)

    def teardown_all(self) -> None:
        for handle in list(self.handles):
            handle.release()
        for pg in reversed(self.groups()):
            pg._teardown()

    def rebuild_all(self, store: dist.Store, epoch: int | str) -> None:
        """Rebuild every group's communicator, in creation order (gloo setup is collective)."""
        for pg in self.groups():
            prefixed = dist.PrefixStore(f"snapshotter/{epoch}/{pg.key}/", store)
            pg._build(prefixed)


class ResumableNcclGroup(ResumableProcessGroup):
    """The same handle over a rebuildable inner NCCL group (only where torch has NCCL)."""

    _backend_type = dist.ProcessGroup.BackendType.NCCL
    _backend_name = NCCL_BACKEND_NAME
    nccl_options: Any = None  # the ProcessGroupNCCL.Options the script's group was made with
    _nccl: Any = None  # the current inner ProcessGroupNCCL

    def _backend_devices(self) -> list[torch.device]:
        return [torch.device("cuda")]

    def _make_backend(self, store: dist.Store) -> Any:
        opts = _REAL_NCCL.Options()
        given = self.nccl_options
        if given is not None:
            opts.is_high_priority_stream = given.is_high_priority_stream
        opts._timeout = self._timeout
        opts.global_ranks_in_group = self._global_ranks
        opts.group_name = self._key
        # No split_from: the communicator it names is gone after a rebuild.
        self._nccl = _REAL_NCCL(store, self.rank(), self.size(), opts)
        return self._nccl

    def _teardown(self) -> None:
        with self._inner_lock:
            inner, self._inner = self._inner, None
        if inner is None:
            return
        # The barrier saw every collective complete; wait for the streams too, so that the
        # communicator is destroyed with no work pending and no kernel holds the GPU.
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
        backend, self._nccl = self._nccl, None
        try:
            backend.shutdown()
        except Exception:  # noqa: BLE001 - a communicator that will not close is aborted
            backend.abort()


class _GlooFactoryMeta(type):
    """Makes `distributed_c10d.ProcessGroupGloo` build resumable groups inside the helper."""

    registry: GroupRegistry

    def __instancecheck__(cls, obj: Any) -> bool:
        native = cls.registry.native_types()
        return isinstance(obj, (_REAL_GLOO, ResumableProcessGroup, *native))

    def __call__(cls, store: dist.Store, rank: int, size: int, timeout: Any = None) -> Any:
        ctx = _creating.get()
        if timeout is None:
            timeout = c10d.default_pg_timeout
        if ctx is None:
            # Not a group being created through torch's helper (e.g. the debug wrapper's helper
            # group): a plain gloo backend, exactly as before.
            return _REAL_GLOO(store, rank, size, timeout=timeout)
        return cls.registry.create(ctx, store, rank, size, timeout)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_REAL_GLOO, name)


class _NcclFactoryMeta(type):
    """`distributed_c10d.ProcessGroupNCCL` that builds resumable NCCL groups in the helper."""

    registry: GroupRegistry

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, (_REAL_NCCL, ResumableNcclGroup))

    def __call__(cls, store: dist.Store, rank: int, size: int, options: Any = None) -> Any:
        ctx = _creating.get()
        if ctx is None:
            return _REAL_NCCL(store, rank, size, options) if options is not None else (
                _REAL_NCCL(store, rank, size))
        timeout = getattr(options, "_timeout", None) or c10d.default_pg_timeout
        return cls.registry.create(ctx, store, rank, size, timeout, nccl_options=options)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_REAL_NCCL, name)  # Options, ...


def install(registry: GroupRegistry) -> None:
    """Route every gloo (and, where torch has it, NCCL) group torch creates from now on
    through `registry`."""
    if getattr(c10d, "_snapshotter_installed", False):
        return
    if _REAL_NCCL is not None:
        nccl = _NcclFactoryMeta("ProcessGroupNCCL", (), {"registry": registry})
        c10d.ProcessGroupNCCL = nccl  # type: ignore[misc,assignment,attr-defined]
    factory = _GlooFactoryMeta("ProcessGroupGloo", (), {"registry": registry})
    original: Any = c10d._new_process_group_helper

    def helper(
        group_size: int,
        group_rank: int,
        global_ranks_in_group: list[int],
        backend: Any,
        store: dist.Store,
        group_name: str,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        token = _creating.set(_Creating(str(group_name), list(global_ranks_in_group), str(backend)))
        try:
            with registry.barrier.setup():
                made = original(
                    group_size,
                    group_rank,
                    global_ranks_in_group,
                    backend,
                    store,
                    group_name,
                    *args,
                    **kwargs,
                )
                native = registry.made.pop(str(group_name), None)
                if native is not None:
                    NativeGlooGroup.settle_registration(made[0], native)
                return made
        finally:
            _creating.reset(token)

    c10d.ProcessGroupGloo = factory  # type: ignore[misc,assignment]
    c10d._new_process_group_helper = helper
    c10d._snapshotter_installed = True  # type: ignore[attr-defined]
