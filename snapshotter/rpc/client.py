"""Calling a snapshotter service: one channel factory, and the generated stubs on top of it.

    stub = coordinator_stub(Target("unix:/var/lib/snapshotter/run/coordinator.sock"), "cli")
    status = stub.Status(pb.JobRef(job_id="job-1"), timeout=30)

The channel's interceptor sends our release (`snapshotter-version`), who we are
(`snapshotter-peer`), the bearer token if one is configured, and the coordinator's fencing
token on calls to agents; it turns every failure into the SnapshotterError the server raised
(status.py), or one that explains a transport failure. Streams come back as iterators that
raise the same errors and cancel the call when dropped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from snapshotter import __version__
from snapshotter.rpc import status
from snapshotter.rpc.tls import COORDINATOR_NAME, TlsFiles
from snapshotter.rpc.wire import FENCE_KEY, OPTIONS, PEER_KEY, VERSION_KEY
from snapshotter.v1 import agent_pb2_grpc, coordinator_pb2_grpc

# A client channel backs off after failed connects (up to 2 minutes by default): an agent
# restarted on the same address must be reachable again within seconds.
CLIENT_OPTIONS = [
    *OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class Target:
    """A service to call, and the credentials to call it with."""

    address: str  # "unix:PATH" or "HOST:PORT"
    tls: TlsFiles | None = None
    # The name the server's certificate must carry (TLS verifies names, not addresses).
    server_name: str = COORDINATOR_NAME
    token: str | None = None
    fence: tuple[int, str] | None = None


class _Stream:
    """A response stream whose failures arrive as SnapshotterErrors."""

    def __init__(self, call: Any, fail: Callable[[grpc.RpcError], Exception]) -> None:
        self._call = call
        self._fail = fail

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as e:
            raise self._fail(e) from e

    def cancel(self) -> None:
        self._call.cancel()

    def __del__(self) -> None:
        try:
            self._call.cancel()
        except Exception:  # noqa: BLE001 - finalizer
            pass


# A call that failed like this never reached the server (no connection, or its TLS handshake
# failed): sending it again cannot do anything twice. The CLI does, after these pauses, so a
# moment's connection trouble on a loaded host is not a failed command; services have their
# own retries and deadlines and do not.
_NOT_SENT = "failed to connect to all addresses"
CLI_RETRY_S = (0.3, 1.0)


def _never_sent(e: grpc.RpcError) -> bool:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else ""
    return code == grpc.StatusCode.UNAVAILABLE and _NOT_SENT in (details or "")


def call_metadata(target: Target, peer: str) -> tuple[tuple[str, str], ...]:
    """What every call to `target` carries: our release, who calls (cli, coordinator, agent),
    the bearer token if one is configured, the coordinator's fencing token on calls to agents."""
    md = [(VERSION_KEY, __version__), (PEER_KEY, peer)]
    if target.token:
        md.append(("authorization", f"Bearer {target.token}"))
    if target.fence is not None:
        md.append((FENCE_KEY, f"{target.fence[0]}:{target.fence[1]}"))
    return tuple(md)


class _Calls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, target: Target, peer: str, server: str) -> None:
        self.target = target
        self.server = server
        self.retries = CLI_RETRY_S if peer == "cli" else ()
        self.metadata = call_metadata(target, peer)

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _Details(
            d.method, d.timeout, (*(d.metadata or ()), *self.metadata), d.credentials,
            d.wait_for_ready, getattr(d, "compression", None),
        )  # fmt: skip

    def _fail(self, method: str) -> Callable[[grpc.RpcError], Exception]:
        def fail(e: grpc.RpcError) -> Exception:
            return status.from_rpc_error(
                e, self.target.address, method, self.server, self.target.tls is not None
            )

        return fail

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        for pause in (*self.retries, None):
            outcome = continuation(self._details(details), request)
            try:
                outcome.result()
            except grpc.RpcError as e:
                if pause is None or not _never_sent(e):
                    raise self._fail(details.method)(e) from e
                time.sleep(pause)
                continue
            return outcome
        raise AssertionError("unreachable")

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return _Stream(continuation(self._details(details), request), self._fail(details.method))


@dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):  # type: ignore[misc]
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def open_channel(target: Target, peer: str, server: str) -> grpc.Channel:
    """A channel to `target`; `peer` says who calls (cli, coordinator, agent), `server` what
    it calls (for messages)."""
    if target.tls is not None:
        ca, cert, key = target.tls.read()
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        options = [*CLIENT_OPTIONS, ("grpc.ssl_target_name_override", target.server_name)]
        channel = grpc.secure_channel(target.address, creds, options=options)
    else:
        channel = grpc.insecure_channel(target.address, options=CLIENT_OPTIONS)
    return grpc.intercept_channel(channel, _Calls(target, peer, server))


class Client:
    """A stub and the channel under it (close() releases the channel)."""

    def __init__(self, channel: grpc.Channel, stub: Any) -> None:
        self.channel = channel
        self.stub = stub

    def close(self) -> None:
        self.channel.close()


def coordinator_client(target: Target, peer: str = "cli") -> Client:
    ch = open_channel(target, peer, "coordinator")
    return Client(ch, coordinator_pb2_grpc.CoordinatorStub(ch))


def agent_client(target: Target, peer: str = "coordinator") -> Client:
    ch = open_channel(target, peer, "agent")
    return Client(ch, agent_pb2_grpc.AgentStub(ch))
