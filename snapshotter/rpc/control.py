"""Many unary calls of a service over one long-lived stream (the Agent service's `Control`).

Why: every phase of a freeze is one call to every node's agent. A new gRPC call costs both
ends far more than a message on a stream already open (HTTP/2 stream set-up, metadata, call
objects): measured here with grpc.aio, 1,024 agents, ~250 us of the caller's CPU a call
against ~100 us a message. The coordinator keeps one Control stream per agent and sends each
call as a ControlRequest; the agent answers each with a ControlReply carrying the same id.

What a carried call is, it stays: the server checks each message as the unary call it stands
for (version, identity, that method's right, the fence, the request's type: server.py), audits
and counts it under that method, runs the same handler, and a failure comes back as the same
typed error. The caller's deadline travels with the message: the handler's `caller_active()`
turns false when it passes, as a unary call's would, and the caller stops waiting then.

    caller (asyncio)                         agent (grpc thread pool)
    call() --ControlRequest{id,...}-->       serve(): each message on a thread of its own
           <--ControlReply{id, reply|error}- (at most MAX_IN_FLIGHT at once per stream)

A stream that breaks (agent restarted, connection lost) fails the calls waiting on it with
the transport's error; the next call opens a new one. An agent of an earlier release (no
Control: UNIMPLEMENTED) is called with unary calls from then on.

Nothing is written on a stream before the server says it serves it: the server sends
READY_KEY in its initial metadata once the stream is admitted, and the caller holds its
messages until then. A message written on a stream the server has already refused made
grpc end it with INTERNAL instead of UNIMPLEMENTED, now and then (grpc/grpc#36066; seen
here under load): the caller could not tell an earlier release from a broken stream.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import math
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from snapshotter import errors, parallel
from snapshotter.rpc import status
from snapshotter.v1 import agent_pb2

METHOD = "/Control"
# In the server's initial metadata: the stream is admitted and served (read before writing).
READY_KEY = "snapshotter-control"
Request = agent_pb2.ControlRequest
Reply = agent_pb2.ControlReply
# A caller may not start threads without bound on a node: past this many calls in flight on
# one stream, a call is refused at once (the coordinator makes one per phase per job).
MAX_IN_FLIGHT = 256
_NAME = re.compile(r"[A-Z][A-Za-z0-9]{0,63}\Z")


def valid_name(name: str) -> bool:
    """Whether `name` can be a method's name in a service (checked before any lookup)."""
    return bool(_NAME.match(name))


@functools.cache
def reply_class(service: ServiceDescriptor, method: str) -> Any:
    """The message class of the unary `method`'s reply (carried replies are bytes)."""
    return message_factory.GetMessageClass(service.methods_by_name[method].output_type)


class Unsupported(Exception):
    """The server has no Control (an earlier release): make the call as a call of its own."""


# ---- the server's side (a grpc thread-pool server; server.py admits the stream) ----


class CarriedContext:
    """The stream's context as one carried call sees it: no longer active once the stream
    is not, or once the call's own deadline has passed."""

    def __init__(self, stream: grpc.ServicerContext, timeout_s: float) -> None:
        self._stream = stream
        # From the network: anything but a positive finite number means no deadline.
        ok = math.isfinite(timeout_s) and timeout_s > 0
        self._deadline = time.monotonic() + timeout_s if ok else None

    def is_active(self) -> bool:
        alive = self._stream.is_active()
        return bool(alive) and (self._deadline is None or time.monotonic() < self._deadline)

    def time_remaining(self) -> float | None:
        own = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        theirs = self._stream.time_remaining()
        if own is None or theirs is None:
            return own if theirs is None else theirs
        return min(own, theirs)

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        # Aborting the stream would fail every call on it: this call fails alone.
        raise errors.Internal(f"{code.name}: {details}", "see the agent's log")

    def abort_with_status(self, st: grpc.Status) -> None:
        raise errors.Internal(f"{st.code}: {st.details}", "see the agent's log")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def serve(
    requests: Iterator[Any],
    context: grpc.ServicerContext,
    dispatch: Callable[[str, bytes, Any], bytes],
    max_in_flight: int | None = None,
) -> Iterator[Any]:
    """The replies to a Control stream's `requests`, as each carried call ends (in any
    order). `dispatch(method, request_bytes, context)` makes one call: its reply serialized,
    or it raises. The calls run at once, each on a thread of the shared pool, so a long one
    (Park waits for the ranks) never holds up the others."""
    limit = MAX_IN_FLIGHT if max_in_flight is None else max_in_flight
    out: queue.SimpleQueue[tuple[Any, bool] | None] = queue.SimpleQueue()
    lock = threading.Lock()
    running = [0]

    def run(req: Any) -> None:
        try:
            body = dispatch(req.method, req.request, CarriedContext(context, req.timeout_s))
            rep = Reply(id=req.id, reply=body)
        except Exception as e:  # noqa: BLE001 - every failure goes back as the call's
            rep = Reply(id=req.id, error=status.error_detail(status.as_snapshotter_error(e)))
        out.put((rep, True))

    def read() -> None:
        try:
            for req in requests:
                with lock:
                    room = running[0] < limit
                    running[0] += room
                if room:
                    parallel.CACHED.submit(run, req)
                    continue
                busy = errors.ServiceUnavailable(
                    f"{limit} calls are already in flight on this Control stream",
                    "wait for some to end, then retry",
                )
                out.put((Reply(id=req.id, error=status.error_detail(busy)), False))
        except Exception:  # noqa: BLE001, S110 - the stream ended under us: no more requests
            pass
        finally:
            out.put(None)

    threading.Thread(target=read, daemon=True, name="control-read").start()
    reading = True
    while True:
        item = out.get()
        if item is None:
            reading = False
        else:
            rep, counted = item
            if counted:
                with lock:
                    running[0] -= 1
            yield rep
        if not reading:
            with lock:
                if running[0] == 0:
                    return


# ---- the caller's side (on rpc/aio.py's event loop) ----


class _Stream:
    """One open Control stream: the calls waiting for a reply on it."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.waiting: dict[int, tuple[asyncio.Future[bytes], str]] = {}
        self.reader: asyncio.Task[None] | None = None
        # One write at a time on a stream (grpc.aio's rule): a call made while another's
        # write is in progress leaves its message to that writer (cheaper than a lock each).
        # Until the server says it serves the stream (`ready`), every message waits.
        self._writing = False
        self._ready = False
        self._queued: collections.deque[Any] = collections.deque()
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, req: Any) -> None:
        self._queued.append(req)
        if not self._writing and self._ready:
            self._writing = True
            await self._flush()

    def ready(self) -> None:
        """The server serves the stream: write what waited (on a task of its own, so that
        the reader goes on reading while the writes wait for flow control)."""
        self._ready = True
        if self._queued and not self._writing:
            self._writing = True
            self._flusher = asyncio.get_running_loop().create_task(self._flush())

    async def _flush(self) -> None:
        """Write every queued message, in order; the caller set `_writing`."""
        try:
            while self._queued:
                await self.call.write(self._queued.popleft())
        except Exception:  # noqa: BLE001 - the stream broke: its reader fails the calls
            self._queued.clear()
        finally:
            self._writing = False


class _Deadlines:
    """The deadlines of calls waiting on this loop, in one heap under one timer: a timer per
    call costs a heap push of Python-compared handles, a third of a carried call's cost at
    2,048 agents. `expire(key)` runs for each deadline that passes (its call may have ended)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._at = float("inf")

    def add(self, loop: asyncio.AbstractEventLoop, timeout: float,
            expire: Callable[[], None]) -> None:  # fmt: skip
        when = loop.time() + timeout
        heapq.heappush(self._heap, (when, next(self._seq), expire))
        if when < self._at:
            self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = when
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._at = None, float("inf")
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2]()
        if self._heap:
            self._arm(loop, self._heap[0][0])


_DEADLINES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deadlines] = (
    weakref.WeakKeyDictionary()
)


def _deadlines(loop: asyncio.AbstractEventLoop) -> _Deadlines:
    d = _DEADLINES.get(loop)
    if d is None:
        d = _DEADLINES[loop] = _Deadlines()
    return d


class Caller:
    """A service's unary calls over its Control stream, opened on the first call and again
    after it broke. `stub`: the service's asyncio stub; `error(rpc_error, method)`: what a
    transport failure means (AioClient._error); `address`: named in a deadline's error."""

    def __init__(
        self,
        stub: Any,
        service: ServiceDescriptor,
        metadata: Any,
        error: Callable[[grpc.aio.AioRpcError, str], Exception],
        address: str,
    ) -> None:
        self._stub = stub
        self._service = service
        self._metadata = metadata
        self._error = error
        self._address = address
        self._ids = itertools.count(1)
        self._stream: _Stream | None = None
        self.supported = True

    async def call(self, method: str, request: Any, timeout: float | None) -> Any:
        """The unary `method`'s reply; raises what the unary call would, or Unsupported."""
        if not self.supported:
            raise Unsupported
        reply_type = reply_class(self._service, method)
        s = self._stream or self._open()
        rid = next(self._ids)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        s.waiting[rid] = (fut, method)
        if timeout is not None:
            _deadlines(loop).add(loop, timeout, functools.partial(self._expire, fut, method))
        try:
            await s.send(Request(id=rid, method=method, request=request.SerializeToString(),
                                 timeout_s=timeout or 0.0))  # fmt: skip
            raw = await fut
        finally:
            s.waiting.pop(rid, None)
        return reply_type.FromString(raw)

    def _open(self) -> _Stream:
        s = _Stream(self._stub.Control(metadata=self._metadata))
        s.reader = asyncio.get_running_loop().create_task(self._read(s, s.call))
        self._stream = s
        return s

    async def _read(self, s: _Stream, call: Any) -> None:
        failure: BaseException | None = None
        try:
            served = await call.initial_metadata()
            if served is not None and any(k == READY_KEY for k, _ in served):
                s.ready()
            # Else the server refused the stream: its status ends the loop below at once.
            # (Every server that serves Control says so: a server of another release than
            # the caller's refuses every call, server.py's version check.)
            async for rep in call:
                fut = s.waiting.get(rep.id, (None, ""))[0]
                if fut is None or fut.done():
                    continue  # its caller stopped waiting (deadline)
                if rep.HasField("error"):
                    fut.set_exception(status.from_detail(rep.error))
                else:
                    fut.set_result(rep.reply)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
            failure = e
        except BaseException as e:
            failure = e
            raise
        finally:
            # No await from here on: a call made after this opens a new stream.
            if self._stream is s:
                self._stream = None
            call.cancel()
            for fut, method in s.waiting.values():
                if not fut.done():
                    fut.set_exception(self._failed(failure, method))

    def _failed(self, failure: BaseException | None, method: str) -> BaseException:
        if not self.supported:
            return Unsupported()
        if isinstance(failure, grpc.aio.AioRpcError):
            return self._error(failure, method)
        return errors.ServiceUnavailable(
            f"the Control stream to {self._address} ended while {method} waited for its reply",
            "retry: the next call opens a new stream",
        )

    def _expire(self, fut: asyncio.Future[bytes], method: str) -> None:
        if not fut.done():
            fut.set_exception(status.deadline_error(method, self._address))

    def close(self) -> None:
        s, self._stream = self._stream, None
        if s is not None and s.reader is not None:
            s.reader.cancel()

