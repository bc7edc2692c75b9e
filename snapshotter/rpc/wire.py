"""gRPC transport for the coordinator and agent services.

Messages are JSON objects carried by grpcio with generic method handlers: the service surface is
a table of `method name -> handler`, unary or server-streaming. This is the ONE place where gRPC
status codes map to snapshotter errors and back: a handler raises a `SnapshotterError`, the
client re-raises the same type with the same cause and next step; transport failures become
`ServiceUnavailable` (UNAVAILABLE) or a timeout error (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

from snapshotter import errors

log = logging.getLogger(__name__)

Msg = dict[str, Any]
Unary = Callable[[Msg], Msg]
Streaming = Callable[[Msg], Iterator[Msg]]

_MAX_MSG = 64 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MSG),
    ("grpc.max_receive_message_length", _MAX_MSG),
]
# A client channel backs off after failed connects (up to 2 minutes by default): an agent
# restarted on the same address must be reachable again within seconds.
_CLIENT_OPTIONS = [
    *_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def _dumps(obj: Msg) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _loads(data: bytes) -> Msg:
    return json.loads(data) if data else {}


_STATUS_FOR = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.JobNotFound: grpc.StatusCode.NOT_FOUND,
    errors.SnapshotNotFound: grpc.StatusCode.NOT_FOUND,
    errors.FreezeRefused: grpc.StatusCode.FAILED_PRECONDITION,
    errors.JobNotRunning: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StorageUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ServiceUnavailable: grpc.StatusCode.UNAVAILABLE,
}


def _status(err: errors.SnapshotterError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in _STATUS_FOR:
            return _STATUS_FOR[cls]  # type: ignore[index]
    return grpc.StatusCode.ABORTED


def _abort(context: grpc.ServicerContext, err: BaseException) -> None:
    if not isinstance(err, errors.SnapshotterError):
        log.exception("internal error in handler", exc_info=err)
        err = errors.Internal(
            f"internal error: {type(err).__name__}: {err}",
            "see the service log; this is a bug worth reporting",
        )
    context.abort(_status(err), json.dumps(err.to_dict()))


# The context of the call the current handler thread serves (None outside a handler).
_CALL: contextvars.ContextVar[grpc.ServicerContext | None] = contextvars.ContextVar(
    "snapshotter_call", default=None
)


def caller_active() -> bool:
    """False once the caller of the call being served has gone (its deadline passed, it was
    cancelled or disconnected): a long handler then undoes what it did instead of finishing
    work nobody will learn of. True outside a handler."""
    ctx = _CALL.get()
    return ctx is None or bool(ctx.is_active())


def _wrap_unary(fn: Unary) -> Callable[[Msg, grpc.ServicerContext], Msg]:
    def handler(req: Msg, context: grpc.ServicerContext) -> Msg:
        token = _CALL.set(context)
        try:
            return fn(req)
        except Exception as e:  # noqa: BLE001 - every failure is mapped to a status
            _abort(context, e)
            raise  # unreachable: abort raises
        finally:
            _CALL.reset(token)

    return handler


def _wrap_stream(fn: Streaming) -> Callable[[Msg, grpc.ServicerContext], Iterator[Msg]]:
    def handler(req: Msg, context: grpc.ServicerContext) -> Iterator[Msg]:
        token = _CALL.set(context)
        try:
            yield from fn(req)
        except Exception as e:  # noqa: BLE001
            _abort(context, e)
        finally:
            _CALL.reset(token)

    return handler


class Server:
    """A gRPC server hosting one or more JSON services on one port."""

    def __init__(self, bind: str, max_workers: int = 32) -> None:
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), options=_OPTIONS
        )
        self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise errors.ServiceUnavailable(
                f"cannot bind gRPC server to {bind}", "choose a free address/port"
            )
        self._host = bind.rsplit(":", 1)[0]

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    def add_service(
        self, name: str, unary: dict[str, Unary], streaming: dict[str, Streaming] | None = None
    ) -> None:
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for meth, fn in unary.items():
            handlers[meth] = grpc.unary_unary_rpc_method_handler(
                _wrap_unary(fn), request_deserializer=_loads, response_serializer=_dumps
            )
        for meth, sfn in (streaming or {}).items():
            handlers[meth] = grpc.unary_stream_rpc_method_handler(
                _wrap_stream(sfn), request_deserializer=_loads, response_serializer=_dumps
            )
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(name, handlers),)
        )

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait()

    def wait(self) -> None:
        self._server.wait_for_termination()


def _to_error(e: grpc.RpcError, target: str, method: str) -> errors.SnapshotterError:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else ""
    if details:
        try:
            d = json.loads(details)
            if isinstance(d, dict) and "code" in d:
                return errors.from_dict(d)
        except ValueError:
            pass
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.ServiceUnavailable(
            f"{method} on {target} did not answer within its deadline",
            "check that the service is alive (`snapshotter jobs`), then retry",
        )
    return errors.ServiceUnavailable(
        f"cannot reach {target} for {method}: {code.name if code else ''} {details}".strip(),
        "start it (the CLI starts the embedded one by itself) or check the address",
    )


class Client:
    """A client of one JSON service at `target` (host:port)."""

    def __init__(self, target: str, service: str) -> None:
        self.target = target
        self.service = service
        self._channel = grpc.insecure_channel(target, options=_CLIENT_OPTIONS)

    def call(self, method: str, req: Msg | None = None, timeout: float | None = 30.0) -> Msg:
        fn = self._channel.unary_unary(
            f"/{self.service}/{method}", request_serializer=_dumps, response_deserializer=_loads
        )
        try:
            return fn(req or {}, timeout=timeout, wait_for_ready=False)  # type: ignore[no-any-return]
        except grpc.RpcError as e:
            raise _to_error(e, self.target, method) from e

    def stream(
        self, method: str, req: Msg | None = None, timeout: float | None = None
    ) -> Iterator[Msg]:
        fn = self._channel.unary_stream(
            f"/{self.service}/{method}", request_serializer=_dumps, response_deserializer=_loads
        )
        it = fn(req or {}, timeout=timeout)
        try:
            yield from it
        except grpc.RpcError as e:
            raise _to_error(e, self.target, method) from e
        finally:
            it.cancel()

    def close(self) -> None:
        self._channel.close()
