"""The provider HTTP/JSON API (FastAPI), a gateway in front of the coordinator's gRPC service.

Every route is one rpc of the contract (ROUTES): the request is the rpc's request message as
protobuf JSON (path and query parameters fill its id fields), the reply its reply message, or
for a streaming rpc (freeze, thaw) {"events": [...]} once it ends. The caller's bearer token is
passed on to the coordinator unchanged, so identity, rights, tenants and the audit log are the
coordinator's, exactly as for the CLI; the gateway itself holds no credential that acts.

Errors are {"error": {"code", "cause", "next_step"}} with the HTTP status of their kind
(STATUS). The OpenAPI document (GET /v1/openapi.json; kept in the repo as
deploy/openapi.json, checked against the app by the tests) takes every body schema from the
.proto descriptors (schema.py).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from snapshotter import __version__, errors
from snapshotter.gateway.schema import ref
from snapshotter.rpc.client import Client, Target, coordinator_client
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
pb = coordinator_pb2
CALL_TIMEOUT_S = 60.0
STREAM_TIMEOUT_S = 3600.0
MAX_BODY = 1 << 20

# HTTP status of each error kind (the error's `code`); any other SnapshotterError is an
# operation that failed (422), never the gateway's own fault.
STATUS = {
    "invalid_argument": 400, "version_mismatch": 400, "unauthenticated": 401,
    "permission_denied": 403, "job_not_found": 404, "snapshot_not_found": 404,
    "freeze_refused": 409, "job_not_running": 409, "service_unavailable": 503,
    "storage_unavailable": 503, "internal": 500,
}  # fmt: skip
ERROR_CODES = (400, 401, 403, 404, 409, 422, 500, 503)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    rpc: str
    request: type[Message]
    reply: type[Message]
    summary: str
    body: bool = False  # the request message (but its path fields) comes as the body
    stream: bool = False
    query: tuple[str, ...] = ()


ROUTES = (
    Route("GET", "/v1/jobs", "Jobs", common_pb2.Empty, pb.JobList, "the caller's jobs"),
    Route("POST", "/v1/jobs", "Run", pb.RunRequest, pb.JobStatus, "launch a job", body=True),
    Route("GET", "/v1/jobs/{job_id}", "Status", common_pb2.JobRef, pb.JobStatus, "a job"),
    Route("POST", "/v1/jobs/{job_id}/cancel", "Cancel", common_pb2.JobRef, pb.JobStatus,
          "stop a job"),
    Route("GET", "/v1/jobs/{job_id}/events", "Events", common_pb2.JobRef, pb.EventList,
          "what the coordinator did and saw for a job"),
    Route("GET", "/v1/jobs/{job_id}/policy", "ShowPolicy", common_pb2.JobRef, pb.PolicyInfo,
          "a job's snapshot policy"),
    Route("PUT", "/v1/jobs/{job_id}/policy", "SetPolicy", pb.SetPolicyRequest, pb.PolicyInfo,
          "change a job's snapshot policy", body=True),
    Route("POST", "/v1/jobs/{job_id}/freeze", "Freeze", pb.FreezeRequest, pb.FreezeEvent,
          "snapshot a job (and stop it with stop=true)", body=True, stream=True),
    Route("GET", "/v1/snapshots", "ListSnapshots", pb.ListSnapshotsRequest, pb.SnapshotList,
          "the caller's committed snapshots", query=("job_id",)),
    Route("GET", "/v1/snapshots/{snapshot_id}", "ShowSnapshot", pb.SnapshotRef,
          pb.SnapshotDetail, "a snapshot"),
    Route("DELETE", "/v1/snapshots/{snapshot_id}", "DeleteSnapshot", pb.SnapshotRef,
          pb.DeleteReply, "delete a snapshot"),
    Route("POST", "/v1/snapshots/{snapshot_id}/thaw", "Thaw", pb.ThawRequest, pb.ThawEvent,
          "resume a snapshot as a job", body=True, stream=True),
    Route("GET", "/v1/nodes", "Nodes", common_pb2.Empty, pb.NodeList, "the nodes (provider)"),
    Route("GET", "/v1/tenants", "Tenants", common_pb2.Empty, pb.TenantList,
          "the tenants (a tenant's caller: its own)"),
    Route("GET", "/v1/tenants/{tenant}", "ShowTenant", pb.TenantRef, pb.TenantInfo,
          "a tenant: what it holds, its limits, where its events go"),
    Route("PUT", "/v1/tenants/{tenant}", "SetTenant", pb.SetTenantRequest, pb.TenantInfo,
          "change a tenant's limits or webhook (provider)", body=True),
)  # fmt: skip


class Clients:
    """One gRPC channel per caller token, the most recent few kept."""

    def __init__(self, address: str, tls: TlsFiles | None, keep: int = 64) -> None:
        self.address = address
        self.tls = tls
        self.keep = keep
        self._lock = threading.Lock()
        self._clients: collections.OrderedDict[str, Client] = collections.OrderedDict()

    def get(self, token: str) -> Client:
        with self._lock:
            c = self._clients.pop(token, None)
            if c is None:
                c = coordinator_client(Target(self.address, tls=self.tls, token=token), "gateway")
            self._clients[token] = c
            while len(self._clients) > self.keep:
                self._clients.popitem(last=False)[1].close()
            return c


def _error(e: errors.SnapshotterError) -> JSONResponse:
    body = {"error": {"code": e.code, "cause": e.cause, "next_step": e.next_step}}
    return JSONResponse(body, status_code=STATUS.get(e.code, 422))


def _bad(cause: str, next_step: str) -> JSONResponse:
    return _error(errors.InvalidArgument(cause, next_step))


def _token(request: Request) -> str:
    value = request.headers.get("authorization")
    if not value:
        raise errors.Unauthenticated(
            "no credential: this API takes a bearer token", "send Authorization: Bearer <token>"
        )
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthenticated(
            "the Authorization header is not 'Bearer <token>'", "send the token as a bearer"
        )
    return token.strip()


def _message(route: Route, params: dict[str, str], body: Any) -> Message:
    if route.body:
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise errors.InvalidArgument(
                f"the body of {route.method} {route.path} is not a JSON object",
                f"send a {route.request.DESCRIPTOR.name} as JSON",
            )
        for k in params:
            if k in body:
                raise errors.InvalidArgument(f"{k} is given by the path, not the body",
                                             f"leave {k} out of the body")  # fmt: skip
        body = {**body, **params}
    else:
        body = params
    try:
        return json_format.ParseDict(body, route.request(), ignore_unknown_fields=False)
    except (json_format.ParseError, TypeError, ValueError, RecursionError) as e:
        raise errors.InvalidArgument(
            f"malformed {route.request.DESCRIPTOR.name}: {e}",
            "send the fields the OpenAPI document (GET /v1/openapi.json) lists, with their types",
        ) from e


def _plain(m: Message) -> dict[str, Any]:
    return json_format.MessageToDict(m, preserving_proto_field_name=True)


def _call(clients: Clients, route: Route, token: str, req: Message) -> dict[str, Any]:
    method = getattr(clients.get(token).stub, route.rpc)
    if route.stream:
        return {"events": [_plain(ev) for ev in method(req, timeout=STREAM_TIMEOUT_S)]}
    return _plain(method(req, timeout=CALL_TIMEOUT_S))


def _endpoint(clients: Clients, route: Route) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> JSONResponse:
        try:
            token = _token(request)
            params = {k: str(v) for k, v in request.path_params.items()}
            params.update({k: v for k, v in request.query_params.items() if k in route.query})
            body: Any = None
            if route.body:
                raw = await request.body()
                if len(raw) > MAX_BODY:
                    return _bad(f"a body of {len(raw)} bytes", f"send at most {MAX_BODY}")
                if raw.strip():
                    try:
                        body = json.loads(raw)
                    except (ValueError, RecursionError) as e:
                        return _bad(f"the body is not JSON: {e}", "send a JSON object")
            req = _message(route, params, body)
            return JSONResponse(await run_in_threadpool(_call, clients, route, token, req))
        except errors.SnapshotterError as e:
            return _error(e)
        except Exception:  # noqa: BLE001 - a bug of ours: logged, never a traceback out
            log.exception("gateway %s %s", route.method, route.path)
            return _error(errors.Internal("the gateway failed on this request",
                                          "see the gateway's log; report it"))  # fmt: skip

    endpoint.__name__ = route.rpc
    return endpoint


# What the coordinator accepts as an id in a path (launch/spec.py, storage/format.py).
ID_PATTERNS = {
    "job_id": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
    "snapshot_id": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
    "tenant": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",  # as storage.format.validate_name
}


def _path_fields(route: Route) -> list[str]:
    return [p.strip("{}") for p in route.path.split("/") if p.startswith("{")]


def _body_schema(route: Route, defs: dict[str, Any]) -> dict[str, Any]:
    """The request message without the fields the path gives."""
    whole = ref(route.request.DESCRIPTOR, defs)
    drop = _path_fields(route)
    if not drop:
        return whole
    name = f"{route.request.DESCRIPTOR.name}Body"
    full = defs[route.request.DESCRIPTOR.name]
    props = {k: v for k, v in full["properties"].items() if k not in drop}
    defs[name] = {**full, "properties": props}
    return {"$ref": f"#/components/schemas/{name}"}


def _operation(route: Route, defs: dict[str, Any]) -> dict[str, Any]:
    params = [{"name": f, "in": "path", "required": True,
               "schema": {"type": "string", "pattern": ID_PATTERNS[f]}}
              for f in _path_fields(route)]  # fmt: skip
    params += [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
               for q in route.query]  # fmt: skip
    reply = ref(route.reply.DESCRIPTOR, defs)
    if route.stream:
        reply = {"type": "object", "properties": {"events": {"type": "array", "items": reply}},
                 "additionalProperties": False}  # fmt: skip
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    responses: dict[str, Any] = {
        "200": {"description": route.summary, "content": {"application/json": {"schema": reply}}}
    }
    for code in ERROR_CODES:
        responses[str(code)] = {"description": "an error: what failed and what to do", **err}
    op: dict[str, Any] = {"operationId": route.rpc, "summary": route.summary,
                          "parameters": params, "responses": responses,
                          "security": [{"bearer": []}]}  # fmt: skip
    if route.body:
        op["requestBody"] = {"required": False, "content": {"application/json": {
            "schema": _body_schema(route, defs)}}}  # fmt: skip
    return op


def openapi(routes: tuple[Route, ...] = ROUTES) -> dict[str, Any]:
    """The OpenAPI document of these routes, its schemas from the .proto descriptors."""
    defs: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        paths.setdefault(r.path, {})[r.method.lower()] = _operation(r, defs)
    text = {"type": "string"}
    defs["Error"] = {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {
            "type": "object", "required": ["code", "cause", "next_step"],
            "properties": {"code": text, "cause": text, "next_step": text}}},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {"title": "snapshotter provider API", "version": __version__},
        "paths": paths,
        "components": {"schemas": dict(sorted(defs.items())),
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }  # fmt: skip


def create_app(coordinator: str, tls: TlsFiles | None = None) -> FastAPI:
    """The API, calling the coordinator at `coordinator` (with `tls`: a `client` certificate
    that may connect; the callers' tokens say who acts)."""
    app = FastAPI(title="snapshotter provider API", version=__version__, openapi_url=None,
                  docs_url=None, redoc_url=None)  # fmt: skip
    clients = Clients(coordinator, tls)
    for r in ROUTES:
        app.add_api_route(r.path, _endpoint(clients, r), methods=[r.method],
                          include_in_schema=False)  # fmt: skip
    document = openapi()
    app.add_api_route("/v1/openapi.json", lambda: JSONResponse(document), methods=["GET"],
                      include_in_schema=False)  # fmt: skip

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        body = {"error": {"code": code, "cause": f"{request.method} {request.url.path}: "
                          f"{e.detail}", "next_step": "see GET /v1/openapi.json"}}  # fmt: skip
        return JSONResponse(body, status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _bad(f"{request.method} {request.url.path}: {e.errors()}", "fix the request")

    return app
