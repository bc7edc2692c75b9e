"""The one place where snapshotter errors and gRPC statuses meet, in both directions.

A handler raises a `SnapshotterError`; the server aborts the call with a `google.rpc.Status`
whose code fits the error class (STATUS_FOR) and whose details carry an `ErrorDetail` with the
error's class, cause, next step and fields. The client rebuilds the same class with the same
fields. Failures below the contract (nothing listening, a deadline, a refused TLS handshake, a
method the server does not know) become `ServiceUnavailable` or `VersionMismatch` with a cause
a person can act on.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from snapshotter import __version__, errors
from snapshotter.v1 import common_pb2

log = logging.getLogger(__name__)

STATUS_FOR: dict[type[errors.SnapshotterError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.JobNotFound: grpc.StatusCode.NOT_FOUND,
    errors.SnapshotNotFound: grpc.StatusCode.NOT_FOUND,
    errors.FreezeRefused: grpc.StatusCode.FAILED_PRECONDITION,
    errors.JobNotRunning: grpc.StatusCode.FAILED_PRECONDITION,
    errors.VersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StorageUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.ServiceUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.Internal: grpc.StatusCode.INTERNAL,
}


def status_code(err: errors.SnapshotterError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_FOR:
            return STATUS_FOR[cls]  # type: ignore[index]
    return grpc.StatusCode.ABORTED


def as_snapshotter_error(err: BaseException) -> errors.SnapshotterError:
    """`err` as what a caller is told (a non-snapshotter error is an Internal one, logged
    with its traceback: it is a bug)."""
    if isinstance(err, errors.SnapshotterError):
        return err
    log.error("internal error in a handler", exc_info=err)
    return errors.Internal(
        f"internal error: {type(err).__name__}: {err}",
        "see the service's log; this is a bug worth reporting",
    )


def error_detail(err: errors.SnapshotterError) -> common_pb2.ErrorDetail:
    """What a caller needs to rebuild `err` (from_detail)."""
    detail = common_pb2.ErrorDetail(code=err.code, cause=err.cause, next_step=err.next_step)
    if err.fields:
        detail.fields.update(_jsonable(err.field_values()))
    return detail


def to_status(err: BaseException) -> grpc.Status:
    """The status a server aborts with for `err`."""
    err = as_snapshotter_error(err)
    code = status_code(err)
    st = status_pb2.Status(code=code.value[0], message=str(err))
    st.details.add().Pack(error_detail(err))
    return rpc_status.to_status(st)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return str(v)


def _native(v: Any) -> Any:
    """Struct numbers are doubles: give integral ones back as ints."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_native(x) for x in v]
    if isinstance(v, dict):
        return {k: _native(x) for k, x in v.items()}
    return v


def detail_of(e: grpc.RpcError) -> errors.SnapshotterError | None:
    """The snapshotter error a server sent, if it sent one."""
    try:
        st = rpc_status.from_call(e)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - a status we cannot read is simply not ours
        return None
    if st is None:
        return None
    for any_ in st.details:
        if any_.Is(common_pb2.ErrorDetail.DESCRIPTOR):
            d = common_pb2.ErrorDetail()
            any_.Unpack(d)
            return from_detail(d)
    return None


def from_detail(d: common_pb2.ErrorDetail) -> errors.SnapshotterError:
    """The error a server described (error_detail), as the same class with the same fields."""
    fields = struct_pb2.Struct()
    fields.CopyFrom(d.fields)
    return errors.from_dict(
        {
            "code": d.code,
            "cause": d.cause,
            "next_step": d.next_step,
            "fields": _native(json_format.MessageToDict(fields)),
        }
    )


def from_rpc_error(
    e: grpc.RpcError, target: str, method: str, server: str, tls: bool
) -> errors.SnapshotterError:
    """What a failed call means, as the error the caller acts on."""
    found = detail_of(e)
    if found is not None:
        return found
    code = e.code() if hasattr(e, "code") else None
    details = (e.details() if hasattr(e, "details") else "") or ""
    short = method.rsplit("/", 1)[-1]
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return deadline_error(short, target)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return errors.VersionMismatch(server, "(another release: it has no " + short + ")",
                                      "client", __version__)  # fmt: skip
    if code == grpc.StatusCode.UNAVAILABLE and tls and _handshake(details):
        return errors.ServiceUnavailable(
            f"the TLS handshake with {target} failed ({details.strip()[:160]}): it refused this "
            "client's certificate or this client refused its",
            "check that both certificates come from the same CA, that this client presents "
            "one (--tls-dir / SNAPSHOTTER_TLS_DIR) and that the server's name matches",
        )
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return errors.Unauthenticated(
            f"{target} refused {short}: {details}", "check the token or certificate you present"
        )
    return errors.ServiceUnavailable(
        f"cannot reach {server} at {target} for {short}: {code.name if code else ''} "
        f"{details}".strip(),
        "start it (the CLI starts the embedded one by itself) or check the address",
    )


def deadline_error(method: str, target: str) -> errors.SnapshotterError:
    return errors.ServiceUnavailable(
        f"{method} on {target} did not answer within its deadline",
        "check that the service is alive (`snapshotter status`), then retry",
    )


def _handshake(details: str) -> bool:
    d = details.lower()
    if "stream removed" in d:
        return False  # a call under way when its connection went (a peer killed mid-stream)
    return any(w in d for w in ("handshake", "ssl", "tls", "certificate", "socket closed",
                                "verification"))
