"""Thousands of calls in flight from one thread: asyncio gRPC channels for fan-outs.

A blocking stub holds a thread for every call in flight. The coordinator calls every node's
agent in each phase of a freeze, and at 2,048 nodes that was 2,048 threads blocked in grpc per
phase: 0.3-0.5 ms of the coordinator's CPU per call, and a host so crowded with runnable
threads that an instant call could miss a 70 s deadline (bench/scale_bench.py). Here one event
loop, on one thread of the process ("snapshotter-aio"), owns every asyncio channel; a caller
on any other thread hands it a whole fan-out and waits for the lot.

The calls carry the same metadata (release, peer, token, fence) and fail with the same
SnapshotterErrors as the blocking client's (client.py).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from snapshotter.rpc import control, status
from snapshotter.rpc.client import CLIENT_OPTIONS, Target, call_metadata

T = TypeVar("T")
# grpc gives a connection attempt max(backoff, min_reconnect_backoff) to finish its handshake:
# the blocking client's 200 ms (a restarted agent is found again at once) is too short when a
# fan-out opens 2,048 channels at once on a busy host ("connection attempt timed out before
# receiving SETTINGS frame"). A refused connection still fails at once; the retry backoff is
# the blocking client's.
_OPTIONS = [
    *((k, v) for k, v in CLIENT_OPTIONS if k != "grpc.min_reconnect_backoff_ms"),
    ("grpc.min_reconnect_backoff_ms", 5000),
]


class Loop:
    """The process's event loop for asyncio channels, on its own daemon thread, started on
    first use."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                t = threading.Thread(target=loop.run_forever, daemon=True, name="snapshotter-aio")
                t.start()
                self._loop, self._thread = loop, t
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (or its exception)."""
        loop = self._get()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Loop.run called on the loop's own thread: it would wait forever")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def cpu_s(self) -> float:
        """CPU seconds the loop's thread has used (0 before it started): what every fan-out
        costs the process, apart from the callers' threads."""
        t = self._thread
        if t is None or t.ident is None or not t.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except OSError:  # the thread ended meanwhile
            return 0.0

    def soon(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start `coro` on the loop without waiting for it; cancelling the future returned
        cancels it there."""
        return asyncio.run_coroutine_threadsafe(coro, self._get())


LOOP = Loop()


def stream_enabled() -> bool:
    """Whether fan-outs carry unary calls over Control streams (control.py); off with
    SNAPSHOTTER_CONTROL_STREAM=0 (to compare, or to rule it out)."""
    return os.environ.get("SNAPSHOTTER_CONTROL_STREAM", "1") != "0"


async def _call_on_loop(fn: Any) -> None:
    fn()


class AioClient:
    """One service reached through an asyncio channel; the channel opens on the first call,
    on the loop's thread (an asyncio channel belongs to the loop it was made on)."""

    def __init__(self, target: Target, stub_class: Any, peer: str, server: str,
                 control_service: ServiceDescriptor | None = None) -> None:  # fmt: skip
        """`control_service`: the service's descriptor when it has a Control stream
        (control.py) to carry its unary calls; None (or SNAPSHOTTER_CONTROL_STREAM=0): every
        call is a call of its own."""
        self.target = target
        self._stub_class = stub_class
        self._server = server
        self._metadata = call_metadata(target, peer)
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._closed = False
        self._control_service = control_service if stream_enabled() else None
        self._control: control.Caller | None = None

    def _open(self) -> Any:
        if self._closed:
            raise RuntimeError(f"the channel to {self.target.address} was closed")
        t = self.target
        if t.tls is not None:
            ca, cert, key = t.tls.read()
            creds = grpc.ssl_channel_credentials(ca, key, cert)
            options = [*_OPTIONS, ("grpc.ssl_target_name_override", t.server_name)]
            self._channel = grpc.aio.secure_channel(t.address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(t.address, options=_OPTIONS)
        self._stub = self._stub_class(self._channel)
        if self._control_service is not None:
            self._control = control.Caller(self._stub, self._control_service, self._metadata,
                                           self._error, t.address)  # fmt: skip
        return self._stub

    async def call(self, method: str, request: Any, timeout: float | None) -> Any:
        """The unary `method` (its name in the service, e.g. "Park"); raises the
        SnapshotterError the server sent or one that explains the transport's failure."""
        stub = self._stub or self._open()
        if self._control is not None and self._control.supported:
            try:
                return await self._control.call(method, request, timeout)
            except control.Unsupported:
                pass  # a server of an earlier release: a call of its own
        try:
            return await getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e, method) from e

    async def stream(
        self, method: str, request: Any, timeout: float | None = None
    ) -> AsyncIterator[Any]:
        """The response-streaming `method`'s messages as they arrive; errors as `call`'s. The
        call is cancelled when the iteration stops early."""
        stub = self._stub or self._open()
        call = getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        try:
            async for msg in call:
                yield msg
        except grpc.aio.AioRpcError as e:
            raise self._error(e, method) from e
        finally:
            call.cancel()

    def _error(self, e: grpc.aio.AioRpcError, method: str) -> Exception:
        return status.from_rpc_error(
            e, self.target.address, method, self._server, self.target.tls is not None
        )

    def end_stream(self) -> None:
        """Close the Control stream, if one is open, and make later calls calls of their own
        (a replaced agent's handle: its stream must not hold a thread of the agent now at its
        address for as long as calls already made on the handle may take)."""
        self._control_service = None
        if self._control is not None:
            LOOP.soon(_call_on_loop(self._control.close))
            self._control = None

    def close(self) -> None:
        """Close the channel (on the loop; calls in flight on it fail)."""
        self._closed = True
        ch, self._channel, self._stub = self._channel, None, None
        self.end_stream()
        if ch is not None:
            LOOP.soon(ch.close())
