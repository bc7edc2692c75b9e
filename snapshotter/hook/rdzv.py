"""A c10d store whose TCP connection can be closed before a dump and re-opened after it.

`ResumableStore` is a Python `torch.distributed.Store` that forwards every call to a real
`TCPStore` client. The `env://` and `tcp://` rendezvous handlers are wrapped so that the store
`init_process_group` receives, and so every `PrefixStore` torch stacks on top of it (the default
group's, each subgroup's, each gloo backend's), ends in a `ResumableStore`. `disconnect` drops the
client (its socket closes); `connect` opens a new one to wherever the agent says the store now
lives. Calls made while disconnected fail loudly: nothing may use the store while the rank is
suspended.

Depends on torch internals: `torch.distributed.rendezvous._rendezvous_handlers` (the handler
table) and pybind's Python-Store trampoline. Imports only stdlib and torch.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from snapshotter.hook.sockets import Owned


class StoreDisconnected(RuntimeError):
    """The rank is suspended: its store connection is closed until the agent resumes it."""


class ResumableStore(dist.Store):
    """Forwards to a TCPStore client that `disconnect`/`connect` can replace under it."""

    def __init__(self, inner: Any, world_size: int | None, owned: Owned) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._inner: Any = inner
        self._world_size = world_size
        self._owned = owned
        self._timeout: timedelta = inner.timeout
        self.host = getattr(inner, "host", "")
        self.port = getattr(inner, "port", 0)

    # ---- lifecycle ---------------------------------------------------------------------------

    def disconnect(self) -> None:
        with self._lock:
            self._inner = None

    def connect(self, host: str, port: int) -> None:
        with self._owned.track():
            client = dist.TCPStore(
                host,
                port,
                self._world_size,
                False,
                self._timeout,
                wait_for_workers=False,
            )
        with self._lock:
            self._inner = client
            self.host, self.port = host, port

    @property
    def connected(self) -> bool:
        return self._inner is not None

    def _store(self) -> Any:
        inner = self._inner
        if inner is None:
            raise StoreDisconnected(
                "snapshotter: the store connection is closed while this rank is suspended"
            )
        return inner

    # ---- dist.Store ---------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return self._store().get(key)

    def add(self, key: str, value: int) -> int:
        return self._store().add(key, value)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._store().compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        return self._store().check(keys)

    def delete_key(self, key: str) -> bool:
        return self._store().delete_key(key)

    def num_keys(self) -> int:
        return self._store().num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        if self._inner is not None:
            self._inner.set_timeout(timeout)

    def append(self, key: str, value: Any) -> None:
        self._store().append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store().multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._store().multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return True

    def queue_push(self, key: str, value: Any) -> None:
        self._store().queue_push(key, value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store().queue_pop(key, block)

    def queue_len(self, key: str) -> int:
        return self._store().queue_len(key)

    def list_keys(self) -> list[str]:
        return self._store().list_keys()


class RdzvRegistry:
    """Every ResumableStore handed out by the wrapped rendezvous handlers, kept alive here.

    pybind's trampoline keeps only the C++ half alive; the Python object must outlive every
    PrefixStore that points at it, so this registry never lets go of one.
    """

    def __init__(self, owned: Owned) -> None:
        self.owned = owned
        self.stores: list[ResumableStore] = []

    def wrap(self, store: dist.Store, world_size: int | None) -> ResumableStore:
        wrapped = ResumableStore(store, world_size, self.owned)
        self.stores.append(wrapped)
        return wrapped

    def disconnect_all(self) -> None:
        for s in self.stores:
            s.disconnect()

    def connect_all(self, host: str, port: int) -> None:
        for s in self.stores:
            s.connect(host, port)


Handler = Callable[..., Iterator[tuple[dist.Store, int, int]]]


def wrap_rendezvous(
    registry: RdzvRegistry,
    gate: Callable[[], AbstractContextManager[None]],
    schemes: tuple[str, ...] = ("env", "tcp"),
) -> None:
    """Make the `env://` and `tcp://` rendezvous hand out ResumableStores. `gate` brackets
    the store's creation, so a freeze never tears down a store being connected."""
    # `torch.distributed.rendezvous` the attribute is a function; the module is only in sys.modules.
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    handlers: dict[str, Handler] = rdzv._rendezvous_handlers
    for scheme in schemes:
        original = handlers.get(scheme)
        if original is None or getattr(original, "_snapshotter", False):
            continue
        handlers[scheme] = _wrapped(original, registry, gate)


def _wrapped(
    original: Handler, registry: RdzvRegistry, gate: Callable[[], AbstractContextManager[None]]
) -> Handler:
    def handler(*args: Any, **kwargs: Any) -> Iterator[tuple[dist.Store, int, int]]:
        inner: Any = original(*args, **kwargs)
        try:
            with gate(), registry.owned.track():
                store, rank, world_size = next(inner)
        finally:
            inner.close()  # the generator's frame must not keep the TCPStore alive
        yield registry.wrap(store, world_size), rank, world_size
        raise RuntimeError("snapshotter: re-rendezvous is not supported")

    handler._snapshotter = True  # type: ignore[attr-defined]
    return handler
