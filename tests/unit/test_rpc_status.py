"""What a failed call means to its caller (snapshotter/rpc/status.py): transport failures
become errors a person can act on, and a connection lost under a call in flight is not
taken for a refused TLS handshake."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from snapshotter import errors
from snapshotter.rpc import status


class Failed(grpc.RpcError):
    """A failed call as grpc raises it, without status details from the server."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Any:
        return ()


def _err(code: grpc.StatusCode, details: str, tls: bool = True) -> errors.SnapshotterError:
    return status.from_rpc_error(Failed(code, details), "10.0.0.3:7071", "/v1.Agent/Upload",
                                 "agent", tls)  # fmt: skip


@pytest.mark.parametrize("details", [
    "Stream removed (Socket closed)",
    "Stream removed (recvmsg:Connection reset by peer (104))",
])  # fmt: skip
def test_a_connection_lost_mid_call_is_unreachable_not_a_tls_refusal(details: str) -> None:
    e = _err(grpc.StatusCode.UNAVAILABLE, details)
    assert isinstance(e, errors.ServiceUnavailable)
    assert e.cause.startswith("cannot reach agent at 10.0.0.3:7071 for Upload"), e.cause
    assert "TLS" not in e.cause and "certificate" not in e.next_step


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.3:7071: "
    "Ssl handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: CERTIFICATE_VERIFY_FAILED",
    "Socket closed",
])  # fmt: skip
def test_a_refused_handshake_is_named_as_one(details: str) -> None:
    e = _err(grpc.StatusCode.UNAVAILABLE, details)
    assert isinstance(e, errors.ServiceUnavailable)
    assert e.cause.startswith("the TLS handshake with 10.0.0.3:7071 failed"), e.cause
    # Without TLS there is no handshake to blame.
    plain = _err(grpc.StatusCode.UNAVAILABLE, details, tls=False)
    assert plain.cause.startswith("cannot reach agent"), plain.cause


def test_a_deadline_names_the_call_and_the_next_step() -> None:
    e = _err(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert isinstance(e, errors.ServiceUnavailable)
    assert e.cause == "Upload on 10.0.0.3:7071 did not answer within its deadline"
    assert "snapshotter status" in e.next_step
