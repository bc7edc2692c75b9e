"""Webhooks from a real coordinator (tests/support/tenants.py) to a real HTTP server on
loopback: a tenant's job events arrive signed, a failing endpoint gets them on a retry, another
tenant's events never arrive, and the receiver's check refuses a replayed, forged or stale
delivery."""

from __future__ import annotations

import http.server
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from snapshotter import errors
from snapshotter.coordinator.quotas import Limits
from snapshotter.coordinator.webhooks import (
    DELIVERY_ID,
    SIGNATURE,
    WebhookConfig,
    WebhookRejected,
    Webhooks,
    sign,
    verify,
)
from snapshotter.rpc.auth import Role
from snapshotter.v1 import common_pb2, coordinator_pb2
from tests.support.tenants import Cluster

pytestmark = pytest.mark.timeout(180)
pb = coordinator_pb2


@dataclass
class Receiver:
    url: str
    got: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    fail_first: int = 0


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    rec = Receiver("")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if rec.fail_first > 0:
                rec.fail_first -= 1
                self.send_response(503)
            else:
                rec.got.append(({k: v for k, v in self.headers.items()}, body))
                self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()


def _until(what: str, cond: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def test_a_tenants_events_arrive_signed_once_and_only_to_it(
    cluster: Cluster, receiver: Receiver
) -> None:
    config = WebhookConfig(None)
    secret = config.set("acme", receiver.url)
    assert secret is not None
    hooks, before = Webhooks(config), cluster.coord.webhooks
    cluster.coord.webhooks = hooks
    try:
        jobs = {}
        for tenant in ("acme", "globex"):
            op = cluster.client(cluster.tokens.create(f"{tenant}-wh", Role.OPERATOR, None,
                                                      tenant=tenant))  # fmt: skip
            st = op.stub.Run(pb.RunRequest(
                script=str(cluster.script), python=sys.executable,
                cwd=str(cluster.script.parent), env={"PATH": "/usr/bin"}), timeout=120)  # fmt: skip
            jobs[tenant] = st.job_id
            receiver.fail_first = 2 if tenant == "acme" else 0  # the endpoint fails twice
            op.stub.SetPolicy(pb.SetPolicyRequest(job_id=st.job_id, policy=common_pb2.Policy(
                every_s=3600.0), every_given=True), timeout=30)  # fmt: skip
        _until("acme's policy event arrives after two failed tries", lambda: receiver.got)
        time.sleep(1.0)  # anything else would have arrived by now
        assert len(receiver.got) == 1 and hooks.delivered == 1, receiver.got
        headers, body = receiver.got[0]
        seen: set[str] = set()
        payload = verify(secret, headers, body, seen)
        assert payload["tenant"] == "acme" and payload["job_id"] == jobs["acme"]
        assert payload["event"]["kind"] == "policy"  # type: ignore[index]
        with pytest.raises(WebhookRejected, match="replay"):
            verify(secret, headers, body, seen)
        with pytest.raises(WebhookRejected, match="does not match"):
            verify("another secret", headers, body, set())
        with pytest.raises(WebhookRejected, match="does not match"):
            verify(secret, headers, body.replace(b"acme", b"acmf"), set())
        old = {**headers, SIGNATURE: sign(secret, body, time.time() - 3600)}
        with pytest.raises(WebhookRejected, match="beyond"):
            verify(secret, old, body, set())
        assert headers[DELIVERY_ID] == payload["id"]
        for job in jobs.values():
            cluster.coord.cancel(job)
    finally:
        hooks.stop()
        cluster.coord.webhooks = before


def test_freezes_and_thaws_a_person_asks_for_reach_the_tenant(
    cluster: Cluster, receiver: Receiver
) -> None:
    config = WebhookConfig(None)
    secret = config.set("acme", receiver.url)
    assert secret is not None
    hooks, before = Webhooks(config), cluster.coord.webhooks
    cluster.coord.webhooks = hooks
    op = cluster.client(cluster.tokens.create("acme-fz", Role.OPERATOR, None, tenant="acme"))
    try:
        st = op.stub.Run(pb.RunRequest(
            script=str(cluster.script), python=sys.executable, cwd=str(cluster.script.parent),
            env={"PATH": "/usr/bin"}), timeout=120)  # fmt: skip
        job = st.job_id
        cluster.coord.limits.set("acme", Limits(max_concurrent_freezes=0))
        with pytest.raises(errors.FreezeRefused):
            list(op.stub.Freeze(pb.FreezeRequest(job_id=job), timeout=60))
        cluster.coord.limits.set("acme", Limits())
        done = [e for e in op.stub.Freeze(pb.FreezeRequest(job_id=job, stop=True), timeout=120)
                if e.HasField("done")]  # fmt: skip
        sid = done[0].done.snapshot_id
        # Where its time went: each phase on the node, the rank's dump, the commit (show has
        # the same spans from the signed manifest, up to the commit; a listing has none).
        spans = list(done[0].done.stats.spans)
        assert {(s.node, s.phase) for s in spans if s.rank == -1} == {
            ("n0", p) for p in ("prepare", "park", "suspend", "dump", "upload", "finish")
        } | {("", "commit")}, spans
        assert [s.rank for s in spans if s.rank >= 0] == [0] and all(
            s.end >= s.start > 0 for s in spans)  # fmt: skip
        shown = op.stub.ShowSnapshot(pb.SnapshotRef(snapshot_id=sid), timeout=30)
        assert list(shown.summary.stats.spans) == [s for s in spans if s.phase != "finish"]
        listed = op.stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=job), timeout=30)
        assert not any(s.stats.spans for s in listed.snapshots)
        thawed = [e for e in op.stub.Thaw(pb.ThawRequest(snapshot_id=sid), timeout=120)
                  if e.HasField("done")]  # fmt: skip
        assert thawed[0].done.job_id == job

        def kinds() -> list[str]:
            return [verify(secret, h, b, set())["event"]["kind"]  # type: ignore[index]
                    for h, b in receiver.got]  # fmt: skip

        _until("the three events arrive", lambda: len(receiver.got) >= 3)
        assert kinds() == ["freeze_failed", "frozen", "thawed"], kinds()
        events = [verify(secret, h, b, set())["event"] for h, b in receiver.got]
        failed, frozen, back = events  # type: ignore[misc]
        assert failed["cause"] == "freeze_refused" and "asked by acme-fz" in failed["detail"]
        assert frozen["snapshot_id"] == sid and "the job stopped" in frozen["detail"]
        assert back["snapshot_id"] == sid and back["nodes"] == ["n0"]
        # The job's own event list has them too, in order.
        listed = [e.kind for e in op.stub.Events(common_pb2.JobRef(job_id=job), timeout=30).events]
        assert listed[-3:] == ["freeze_failed", "frozen", "thawed"], listed
        cluster.coord.cancel(job)
    finally:
        cluster.coord.limits.set("acme", Limits())
        hooks.stop()
        cluster.coord.webhooks = before
