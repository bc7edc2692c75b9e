"""The provider HTTP/JSON API, in front of a real coordinator (tests/support/tenants.py: two
tenants, each with a running job and a snapshot).

schemathesis fuzzes every operation of the OpenAPI document through the real app: nothing
answers 5xx, every reply matches the document. Then over real HTTP on loopback (uvicorn): the
tenant matrix holds through the gateway (the coordinator decides, from the caller's own token),
bad credentials are refused, and the document in the repo is the one the app serves, its routes
the contract's rpcs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from snapshotter import errors
from snapshotter.gateway.app import ROUTES, create_app, openapi
from snapshotter.gateway.serve import Gateway, GatewayConfig
from snapshotter.rpc.auth import Role
from snapshotter.v1 import coordinator_pb2
from tests.support.tenants import Cluster

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def viewer(cluster: Cluster) -> str:
    return cluster.tokens.create("acme-api", Role.VIEWER, None, tenant="acme")


def test_every_operation_survives_fuzzing(cluster: Cluster, viewer: str) -> None:
    """schemathesis's cases for each operation (its pytest plugin is driven by hand: it does
    not load under this pytest), as a tenant's viewer: every operation is reached and its
    input parsed, and nothing is changed."""
    api = schemathesis.openapi.from_asgi("/v1/openapi.json", create_app(cluster.address))
    ran = []
    for result in api.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy())
        @settings(max_examples=12, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def fuzz(case: Any) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {viewer}"})

        fuzz()
        ran.append(op.label)
    assert len(ran) == len(ROUTES), ran


@pytest.fixture(scope="module")
def gateway(cluster: Cluster) -> Iterator[str]:
    gw = Gateway(GatewayConfig(listen="127.0.0.1:0", coordinator=cluster.address)).start()
    try:
        yield f"http://{gw.address}"
    finally:
        gw.stop()


def _http(url: str, method: str = "GET", token: str | None = None,
          body: Any = None) -> tuple[int, Any]:  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tenants_through_the_gateway_and_bad_credentials(gateway: str, cluster: Cluster) -> None:
    acme = cluster.tokens.create("acme-http", Role.OPERATOR, None, tenant="acme")
    code, body = _http(f"{gateway}/v1/jobs", token=acme)
    assert code == 200 and [j["job_id"] for j in body["jobs"]] == [cluster.jobs["acme"]]
    assert all(j["tenant"] == "acme" for j in body["jobs"])
    code, body = _http(f"{gateway}/v1/jobs/{cluster.jobs['acme']}", token=acme)
    assert code == 200 and body["state"] == "RUNNING"
    # The other tenant's job and snapshot: exactly like ids nobody has.
    for url in (f"/v1/jobs/{cluster.jobs['globex']}", f"/v1/snapshots/{cluster.snaps['globex']}",
                "/v1/jobs/job-nobody", "/v1/snapshots/job-nobody-s1"):  # fmt: skip
        code, body = _http(gateway + url, token=acme)
        assert code == 404 and body["error"]["code"].endswith("_not_found"), (url, body)
    code, body = _http(f"{gateway}/v1/jobs/{cluster.jobs['globex']}/freeze", "POST", acme, {})
    assert code == 404 and body["error"]["code"] == "job_not_found"
    code, body = _http(f"{gateway}/v1/nodes", token=acme)
    assert code == 403 and body["error"]["code"] == "permission_denied"
    code, body = _http(f"{gateway}/v1/jobs", "POST", acme, {"script": "x.py", "tenant": "globex"})
    assert code == 403 and "may not launch jobs of tenant" in body["error"]["cause"]
    code, body = _http(f"{gateway}/v1/jobs", "POST", acme, {"script": 3, "bogus": 1})
    assert code == 400 and body["error"]["code"] == "invalid_argument", body
    assert body["error"]["next_step"]
    # Credentials: none, malformed, forged, expired.
    assert _http(f"{gateway}/v1/jobs")[0] == 401
    assert _http(f"{gateway}/v1/jobs", token="hunter2")[0] == 401
    assert _http(f"{gateway}/v1/jobs", token=acme[:-4] + "AAAA")[0] == 401
    expired = cluster.tokens.create("old", Role.VIEWER, -1.0, tenant="acme")
    code, body = _http(f"{gateway}/v1/jobs", token=expired)
    assert code == 401 and "expired" in body["error"]["cause"]
    # The provider sees both; unknown routes answer in the API's error shape.
    admin = cluster.tokens.create("provider-http", Role.ADMIN, None)
    code, body = _http(f"{gateway}/v1/snapshots", token=admin)
    assert code == 200 and {s["tenant"] for s in body["snapshots"]} == {"acme", "globex"}
    code, body = _http(f"{gateway}/v2/whatever", token=admin)
    assert code == 404 and body["error"]["code"] == "not_found"
    # Tenants as a resource: a tenant sees its own; limits are the provider's to set.
    code, body = _http(f"{gateway}/v1/tenants", token=acme)
    assert code == 200 and [t["tenant"] for t in body["tenants"]] == ["acme"], body
    for who in ("globex", "nobody"):
        code, body = _http(f"{gateway}/v1/tenants/{who}", token=acme)
        assert code == 403 and "sees its own tenant 'acme' only" in body["error"]["cause"]
    code, body = _http(f"{gateway}/v1/tenants/acme", "PUT", acme, {"max_stored_bytes": "1"})
    assert code == 403 and body["error"]["code"] == "permission_denied"
    code, body = _http(f"{gateway}/v1/tenants/globex", "PUT", admin,
                       {"max_concurrent_freezes": 3})  # fmt: skip
    assert code == 200 and body["max_concurrent_freezes"] == 3, body
    code, body = _http(f"{gateway}/v1/tenants/globex", "PUT", admin,
                       {"max_concurrent_freezes": -1})  # fmt: skip
    assert code == 200 and "max_concurrent_freezes" not in body, body
    code, body = _http(f"{gateway}/v1/tenants/bad%20name", token=admin)
    assert code == 400 and body["error"]["code"] == "invalid_argument", body


def test_the_document_in_the_repo_is_the_served_one_and_matches_the_contract(
    gateway: str,
) -> None:
    committed = json.loads((REPO / "proto" / "openapi.json").read_text())
    assert committed == openapi(), "run `python deploy/gen_proto.py` and commit proto/openapi.json"
    code, served = _http(f"{gateway}/v1/openapi.json")
    assert code == 200 and served == committed
    service = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
    for r in ROUTES:
        m = service.methods_by_name[r.rpc]
        assert m.input_type.name == r.request.DESCRIPTOR.name, r
        assert m.output_type.name == r.reply.DESCRIPTOR.name, r
        assert m.server_streaming == r.stream, r
        op = committed["paths"][r.path][r.method.lower()]
        assert op["operationId"] == r.rpc


def test_plain_http_beyond_loopback_is_refused() -> None:
    with pytest.raises(errors.InvalidArgument, match="without HTTPS"):
        Gateway(GatewayConfig(listen="0.0.0.0:0", coordinator="127.0.0.1:1"))
