"""Serving a snapshotter service: bound only where the policy allows, every call checked alike.

Where a service may listen (`check_listen`):
  unix:PATH          the embedded daemon: the socket's directory is 0700 and the socket 0600,
                     so only root connects (and is trusted with every right)
  loopback TCP       plaintext, but every caller needs a bearer token (auth.TokenStore)
  any other address  mutual TLS only (--tls-dir or --tls-ca/--tls-cert/--tls-key); a token
                     may narrow who acts behind a machine certificate
  --insecure         plaintext and no authentication anywhere: for tests, and said so loudly

Every call to our services passes `_Checks` (one server interceptor), in this order:
  1. version   a `snapshotter-version` of another major.minor release: VersionMismatch
  2. identity  token, certificate, unix socket or --insecure (auth.py): else Unauthenticated
  3. right     the method's right from the .proto: else PermissionDenied naming it
  4. extra     the service's own check (an agent's fencing token)
  5. request   parsed here, so a malformed message is an InvalidArgument, not a crash
  6. handler   a raised SnapshotterError becomes a typed status (status.py)
A Control stream (control.py: unary calls carried as messages) is admitted by checks 1-3 for
its own right, and then every message passes 1-6 as the call it stands for. A Relayed call
(relay.py: a call the coordinator signed, delivered by another node) passes 1-3 as itself,
then the order's checks (relay.Trust), then 3-6 as the call it carries, made by the
coordinator, with the order's fence.
Health (grpc.health.v1) and server reflection answer without credentials, so grpcurl and
load balancers work with no code of ours.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from snapshotter import __version__, errors, metrics
from snapshotter.rpc import auth, control, status
from snapshotter.rpc.audit import REFUSALS, AuditLog
from snapshotter.rpc.tls import TlsFiles
from snapshotter.rpc.wire import FENCE_KEY, OPTIONS, PEER_KEY, VERSION_KEY
from snapshotter.v1 import agent_pb2

if TYPE_CHECKING:  # relay.py calls through the clients, which import this module
    from snapshotter.rpc import relay

log = logging.getLogger(__name__)

_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_RELAYED = "/Relayed"

# The call the current handler thread serves: its context and who made it.
_CALL: contextvars.ContextVar[tuple[grpc.ServicerContext, auth.Identity] | None] = (
    contextvars.ContextVar("snapshotter_call", default=None)
)


def caller_active() -> bool:
    """False once the caller of the call being served has gone (deadline passed, cancelled,
    disconnected): a long handler then undoes its work instead of finishing it for nobody.
    True outside a handler."""
    call = _CALL.get()
    return call is None or bool(call[0].is_active())


def caller() -> auth.Identity | None:
    call = _CALL.get()
    return None if call is None else call[1]


@dataclass(frozen=True)
class Listen:
    """Where and how a service listens."""

    address: str  # "unix:PATH" or "HOST:PORT"
    tls: TlsFiles | None = None
    tokens: auth.TokenStore | None = None
    insecure: bool = False

    @property
    def unix(self) -> bool:
        return self.address.startswith("unix:")

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0].strip("[]")


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen(listen: Listen, what: str) -> None:
    """Raises: InvalidArgument when the policy forbids listening like this."""
    if listen.unix or listen.tls is not None or listen.insecure:
        return
    if not is_loopback(listen.host):
        raise errors.InvalidArgument(
            f"refusing to serve the {what} on {listen.address} without TLS: anyone who reaches "
            "it could start processes as root on this node",
            "give it certificates (--tls-dir DIR, made by `snapshotter certs init DIR`), "
            "listen on a loopback address, or for a test pass --insecure",
        )
    if listen.tokens is None:
        raise errors.InvalidArgument(
            f"the {what} on loopback {listen.address} without TLS authenticates callers by "
            "bearer token, but has no token file",
            "pass --tokens FILE (`snapshotter token create --file FILE` makes one)",
        )


class _Checks(grpc.ServerInterceptor):
    def __init__(
        self,
        kind: str,
        listen: Listen,
        extra: Callable[[str, Mapping[str, str]], None] | None,
        audit: AuditLog | None = None,
        trust: relay.Trust | None = None,
    ) -> None:
        self.kind = kind
        self.trust = trust
        self.listen = listen
        self.extra = extra
        self.audit = audit
        self.rights = auth.method_rights()
        # Every method's handler as registered, by full name: what a Control message is
        # served by (grpc gives an interceptor only the handler of the call it intercepts).
        self.handlers: dict[str, Any] = {}
        self.metrics = metrics.RPC[kind] if kind in metrics.RPC else metrics.RpcMetrics(
            metrics.CollectorRegistry())  # another kind (tests' fakes): counted, not served

    def intercept_service(
        self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = continuation(details)
        method = details.method
        if handler is None or method.startswith(_OPEN_SERVICES):
            return handler
        md = {k: v for k, v in details.invocation_metadata if isinstance(v, str)}
        if handler.unary_unary is not None:
            call = self._unary(method, handler, md)

            def unary(raw: bytes, context: grpc.ServicerContext) -> Any:
                try:
                    return call(raw, context)
                except Exception as e:  # noqa: BLE001 - every failure becomes a status
                    context.abort_with_status(status.to_status(e))

            return grpc.unary_unary_rpc_method_handler(
                unary, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            return self._checked_stream(method, handler, md)
        if handler.stream_stream is not None and method.endswith(control.METHOD):
            return self._control(details, md)
        return handler

    def _audit(self, method: str, who: auth.Identity | None, request: Any,
               err: BaseException | None) -> None:  # fmt: skip
        if self.audit is None:
            return
        right = self.rights.get(method, auth.Right.ADMINISTER)
        code = getattr(err, "code", "error") if err is not None else "ok"
        if right not in (auth.Right.OPERATE, auth.Right.ADMINISTER) and code not in REFUSALS:
            return
        cause = getattr(err, "cause", str(err)) if err is not None else ""
        try:
            self.audit.record(who, method, request, str(code), str(cause))
        except OSError as e:  # the call's outcome stands; the log says it lost a line
            log.error("audit log %s: %s (lost: %s %s)", self.audit.path, e, method, code)

    def _admit(
        self, method: str, md: Mapping[str, str], context: grpc.ServicerContext,
        parse: Callable[[bytes], Any] | None, raw: bytes, who: auth.Identity | None = None,
    ) -> tuple[Any, auth.Identity]:  # fmt: skip
        """Checks 1-5 of the module docstring; the parsed request and who sent it. `who`:
        the caller as a relayed order established it (no version or identity check then)."""
        if who is None:
            self._check_version(md)
            who = self._identify(md, context)
        auth.authorize(who, method, self.rights.get(method, auth.Right.ADMINISTER))
        if self.extra is not None:
            self.extra(method, md)
        try:
            request = parse(raw) if parse is not None else raw
        except DecodeError as e:
            raise errors.InvalidArgument(
                f"malformed request for {method}: {e}",
                "send a message of the request type the .proto declares for it",
            ) from e
        return request, who

    @contextlib.contextmanager
    def _counted(self, method: str) -> Iterator[list[str]]:
        """The call's duration and code into the service's metrics (metrics.py)."""
        t0 = time.monotonic()
        outcome = ["abandoned"]  # a stream whose caller went away ends without either
        in_flight = self.metrics.in_flight.labels(method.rsplit("/", 1)[-1])
        in_flight.inc()
        try:
            yield outcome
            outcome[0] = "ok" if outcome[0] == "abandoned" else outcome[0]
        finally:
            in_flight.dec()
            self.metrics.observe(method, outcome[0], time.monotonic() - t0)

    @contextlib.contextmanager
    def _serving(self, method: str, md: Mapping[str, str], context: grpc.ServicerContext,
                 parse: Callable[[bytes], Any] | None, raw: bytes,
                 as_who: auth.Identity | None = None) -> Iterator[Any]:  # fmt: skip
        """One call through every check: yields its request to the handler's code, and
        audits and counts it however that ends (a failure is raised on)."""
        who: auth.Identity | None = as_who
        request: Any = None
        with self._counted(method) as outcome:
            try:
                request, who = self._admit(method, md, context, parse, raw, as_who)
                token = _CALL.set((context, who))
                try:
                    yield request
                finally:
                    _CALL.reset(token)
                self._audit(method, who, request, None)
            except Exception as e:
                outcome[0] = str(getattr(e, "code", "internal"))
                self._audit(method, who, request, e)
                raise

    def _checked(
        self, method: str, handler: Any, md: Mapping[str, str],
        who: auth.Identity | None = None,
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:  # fmt: skip
        """The unary `handler` behind every check: returns its reply, raises its failure."""
        inner, parse = handler.unary_unary, handler.request_deserializer

        def call(raw: bytes, context: grpc.ServicerContext) -> Any:
            with self._serving(method, md, context, parse, raw, who) as request:
                return inner(request, context)

        return call

    def _unary(
        self, method: str, handler: Any, md: Mapping[str, str]
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:
        """A unary call, of its own or carried by Control: Relayed where this server takes
        relayed calls, else the handler behind every check."""
        if self.trust is not None and method.endswith(_RELAYED):
            return self._relayed(method, md)
        return self._checked(method, handler, md)

    def _relayed(
        self, method: str, md: Mapping[str, str]
    ) -> Callable[[bytes, grpc.ServicerContext], Any]:
        """Relayed (relay.py): admitted as a call of its own (a node's right), then the
        order's checks; the call it carries runs as the coordinator's, with the order's
        fence. A refused order fails this call (the relay reports it undelivered); the
        carried call's own failure is its reply's error, as on a Control stream."""
        service = method[: -len(_RELAYED)]
        trust = self.trust
        assert trust is not None

        def run(call: agent_pb2.RelayedCall, context: grpc.ServicerContext) -> Any:
            order = trust.admit(call.order, call.signature)
            full = f"{service}/{order.method}"
            h = self.handlers.get(full)
            if h is None or h.unary_unary is None:
                raise errors.InvalidArgument(f"{full} is not served here", "upgrade the node")
            who = auth.Identity(f"coordinator (relayed by {caller() or '?'})",
                                auth.Role.COORDINATOR, "relay")  # fmt: skip
            inner_md = {FENCE_KEY: order.fence} if order.fence else {}
            try:
                reply = self._checked(full, h, inner_md, who)(
                    order.request, control.CarriedContext(context, order.timeout_s))
                return agent_pb2.ControlReply(reply=h.response_serializer(reply))
            except Exception as e:  # noqa: BLE001 - the carried call's failure is its reply's
                return agent_pb2.ControlReply(
                    error=status.error_detail(status.as_snapshotter_error(e)))

        def relayed(raw: bytes, context: grpc.ServicerContext) -> Any:
            with self._serving(method, md, context, agent_pb2.RelayedCall.FromString,
                               raw) as call:  # fmt: skip
                return run(call, context)

        return relayed

    def _checked_stream(self, method: str, handler: Any, md: Mapping[str, str]) -> Any:
        inner_s, parse = handler.unary_stream, handler.request_deserializer

        def stream(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                with self._serving(method, md, context, parse, raw) as request:
                    yield from inner_s(request, context)
            except Exception as e:  # noqa: BLE001 - every failure becomes a status
                context.abort_with_status(status.to_status(e))

        return grpc.unary_stream_rpc_method_handler(
            stream, response_serializer=handler.response_serializer
        )

    def _control(self, details: grpc.HandlerCallDetails, md: Mapping[str, str]) -> Any:
        """The Control stream (control.py): admitted as a call of its own (version, identity,
        its right), then every message it carries passes every check as the unary call it
        stands for, with the stream's metadata."""
        service = details.method[: -len(control.METHOD)]
        calls: dict[str, tuple[Callable[..., Any], Callable[[Any], bytes]]] = {}

        def resolve(name: str) -> tuple[Callable[..., Any], Callable[[Any], bytes]]:
            if name not in calls:
                full = f"{service}/{name}"
                h = None
                if control.valid_name(name) and not full.endswith(control.METHOD):
                    h = self.handlers.get(full)
                if h is None or h.unary_unary is None:
                    raise errors.InvalidArgument(
                        f"{name[:64]!r} is not a unary method of {service.lstrip('/')}",
                        "carry only the service's unary calls over Control",
                    )
                calls[name] = (self._unary(full, h, md), h.response_serializer)
            return calls[name]

        def dispatch(name: str, raw: bytes, context: grpc.ServicerContext) -> bytes:
            call, serialize = resolve(name)
            return serialize(call(raw, context))

        def serve_control(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            who: auth.Identity | None = None
            try:
                self._check_version(md)
                who = self._identify(md, context)
                self._may_carry(who, details.method, service)
            except Exception as e:  # noqa: BLE001 - a refused stream is a status, as a call
                self._audit(details.method, who, None, e)
                context.abort_with_status(status.to_status(e))
            # Admitted: the caller writes its first message once it reads this (control.py).
            context.send_initial_metadata(((control.READY_KEY, "1"),))
            # In flight: the streams open now (the calls they carry count as their methods).
            with self._counted(details.method):
                yield from control.serve(requests, context, dispatch)

        return grpc.stream_stream_rpc_method_handler(
            serve_control,
            request_deserializer=control.Request.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )

    def _may_carry(self, who: auth.Identity, method: str, service: str) -> None:
        """A Control stream only carries calls, each checked for its own right: it may be
        opened with the stream's own right (VIEW: what a coordinator or a viewer has) or
        with the right of a call it could carry (a node relaying: TRANSFER, relay.py); a
        role with no right of the service's (a bare client certificate) may not hold one."""
        own = self.rights.get(method, auth.Right.ADMINISTER)
        carried = {r for m, r in self.rights.items()
                   if m.startswith(f"{service}/") and not m.endswith(control.METHOD)}  # fmt: skip
        have = auth.ROLE_RIGHTS[who.role]
        if own in have or have & carried:
            return
        auth.authorize(who, method, own)  # raises, naming the right

    def _check_version(self, md: Mapping[str, str]) -> None:
        theirs = md.get(VERSION_KEY)
        if theirs is not None and _release(theirs) != _release(__version__):
            raise errors.VersionMismatch(self.kind, __version__, md.get(PEER_KEY, "client"), theirs)

    def _identify(self, md: Mapping[str, str], context: grpc.ServicerContext) -> auth.Identity:
        token = auth.bearer(md)
        if token is not None:
            if self.listen.tokens is None:
                raise errors.Unauthenticated(
                    f"this {self.kind} does not accept bearer tokens (it has no token file)",
                    "present a client certificate, or start it with --tokens FILE",
                )
            return self.listen.tokens.verify(token)
        if self.listen.unix:
            return auth.Identity("root", auth.Role.ROOT, "unix")
        if self.listen.insecure:
            return auth.Identity("anyone", auth.Role.ROOT, "insecure")
        if self.listen.tls is not None:
            pems = context.auth_context().get("x509_pem_cert") or []
            if pems:
                name, role = auth.role_of_certificate(pems[0])
                return auth.Identity(name, role, "certificate")
        raise errors.Unauthenticated(
            f"no credential: this {self.kind} accepts "
            + ("a client certificate or a bearer token" if self.listen.tls else "bearer tokens"),
            "pass --token-file (or SNAPSHOTTER_TOKEN), or a client certificate (--tls-dir)",
        )


class _Recording:
    """The server as `register` sees it: the method handlers it adds are also kept by full
    method name (the generated add_*Servicer_to_server functions register them this way)."""

    def __init__(self, server: grpc.Server, into: dict[str, Any]) -> None:
        self._server = server
        self._into = into

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self._into.update({f"/{service}/{m}": h for m, h in handlers.items()})
        self._server.add_registered_method_handlers(service, handlers)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


def _release(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


class Served:
    """A running server: its actual address (with the port it bound) and how to stop it."""

    def __init__(self, server: grpc.Server, address: str, health_servicer: Any, sock: Path | None):
        self._server = server
        self.address = address
        self.health = health_servicer
        self._sock = sock

    def stop(self, grace: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.unlink()

    def wait(self) -> None:
        self._server.wait_for_termination()


def serve(
    kind: str,
    listen: Listen,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    extra_check: Callable[[str, Mapping[str, str]], None] | None = None,
    max_workers: int = 32,
    audit: AuditLog | None = None,
    trust: relay.Trust | None = None,
) -> Served:
    """Start `kind` ("coordinator", "agent") on `listen` with the servicers `register` adds.
    `audit`: where every action and every refused caller is recorded (audit.py); `trust`:
    whose relayed calls it runs (relay.py; None: Relayed is served as any other method).

    Raises:
        InvalidArgument: the listen policy forbids this address (check_listen).
        ServiceUnavailable: the address cannot be bound.
    """
    check_listen(listen, kind)
    if listen.insecure:
        msg = (
            f"WARNING: the {kind} serves {listen.address} with NO TLS and NO authentication "
            "(--insecure): anyone who reaches it can run processes as root"
        )
        log.warning(msg)
        print(msg, file=sys.stderr, flush=True)
    checks = _Checks(kind, listen, extra_check, audit, trust)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{kind}-rpc"),
        interceptors=[checks],
        options=OPTIONS,
    )
    register(_Recording(server, checks.handlers))  # type: ignore[arg-type]
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    sock: Path | None = None
    if listen.unix:
        sock = Path(listen.address.removeprefix("unix:"))
        _prepare_socket_dir(sock)
        port = server.add_insecure_port(listen.address)
        address = listen.address
    else:
        if listen.tls is not None:
            ca, cert, key = listen.tls.read()
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=True)  # fmt: skip
            port = _bind(server.add_secure_port, listen.address, creds)
        else:
            port = _bind(server.add_insecure_port, listen.address)
        address = f"{listen.address.rsplit(':', 1)[0]}:{port}"
    if port == 0:
        raise errors.ServiceUnavailable(
            f"cannot bind the {kind} to {listen.address}", "choose a free address/port"
        )
    server.start()
    if sock is not None:
        os.chmod(sock, 0o600)
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, address, health_servicer, sock)


def _bind(add: Callable[..., int], address: str, *creds: Any) -> int:
    try:
        return add(address, *creds)
    except RuntimeError:
        return 0


def _prepare_socket_dir(sock: Path) -> None:
    """A private directory for the socket; a stale socket (no server behind it) is removed."""
    sock.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(sock.parent, 0o700)
    if sock.exists():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(sock))
        except OSError:
            sock.unlink()
        else:
            raise errors.ServiceUnavailable(
                f"another service already listens on {sock}", "stop it first (`snapshotter down`)"
            )
        finally:
            probe.close()
