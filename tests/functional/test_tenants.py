"""Tenants, through a real coordinator on a real gRPC server (loopback, bearer tokens) driving a
real node agent that runs real processes: the full matrix of 2 tenants x every coordinator
endpoint x every role. A tenant's token sees and acts on its own jobs and snapshots only; to it,
the other tenant's ids answer exactly like ids nobody has; cluster calls are refused to it; the
provider's admin acts on all. Every action and every refusal lands in the audit log."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from snapshotter import errors
from snapshotter.coordinator.quotas import Limits
from snapshotter.rpc import audit
from snapshotter.rpc.auth import Role
from snapshotter.rpc.client import Client
from snapshotter.v1 import common_pb2, coordinator_pb2
from tests.support.tenants import Cluster

pytestmark = pytest.mark.timeout(180)
pb = coordinator_pb2


def _calls(job: str, snap: str) -> dict[str, Callable[[Client], Any]]:
    """Every coordinator endpoint, aimed at `job` / `snap` where it takes an id."""
    ref = common_pb2.JobRef(job_id=job)
    return {
        "Status": lambda c: c.stub.Status(ref, timeout=30),
        "Wait": lambda c: c.stub.Wait(common_pb2.WaitRequest(job_id=job, timeout_s=0.1),
                                      timeout=30),  # fmt: skip
        "Logs": lambda c: list(c.stub.Logs(common_pb2.LogsRequest(job_id=job), timeout=30)),
        "Events": lambda c: c.stub.Events(ref, timeout=30),
        "ShowPolicy": lambda c: c.stub.ShowPolicy(ref, timeout=30),
        "SetPolicy": lambda c: c.stub.SetPolicy(pb.SetPolicyRequest(job_id=job, clear=True),
                                                timeout=30),  # fmt: skip
        "Freeze": lambda c: list(c.stub.Freeze(pb.FreezeRequest(job_id=job), timeout=30)),
        "Migrate": lambda c: list(c.stub.Migrate(pb.MigrateRequest(job_id=job, node="n0",
                                                                   to="n9"), timeout=30)),
        "Cancel": lambda c: c.stub.Cancel(ref, timeout=30),
        "ShowSnapshot": lambda c: c.stub.ShowSnapshot(pb.SnapshotRef(snapshot_id=snap),
                                                      timeout=30),  # fmt: skip
        "Thaw": lambda c: list(c.stub.Thaw(pb.ThawRequest(snapshot_id=snap), timeout=30)),
        "DeleteSnapshot": lambda c: c.stub.DeleteSnapshot(pb.SnapshotRef(snapshot_id=snap),
                                                          timeout=30),  # fmt: skip
    }  # fmt: skip


CLUSTER_CALLS: dict[str, Callable[[Client], Any]] = {
    "Nodes": lambda c: c.stub.Nodes(common_pb2.Empty(), timeout=30),
    "Drain": lambda c: c.stub.Drain(pb.DrainRequest(node="n0", undo=True), timeout=30),
    "Link": lambda c: c.stub.Link(pb.LinkRequest(node="n0", iface="eth9"), timeout=30),
    "Gc": lambda c: c.stub.Gc(pb.GcRequest(), timeout=30),
    "SetTenant": lambda c: c.stub.SetTenant(pb.SetTenantRequest(tenant="acme"), timeout=30),
}
NEEDS_OPERATE = {"SetPolicy", "Freeze", "Migrate", "Cancel", "Thaw"}


def _error(call: Callable[[Client], Any], c: Client) -> errors.SnapshotterError | None:
    try:
        call(c)
    except errors.SnapshotterError as e:
        return e
    return None


@pytest.mark.parametrize("role", [Role.VIEWER, Role.OPERATOR])
def test_a_tenant_never_reaches_another_tenants_jobs_or_snapshots(
    cluster: Cluster, role: Role
) -> None:
    for me, other in (("acme", "globex"), ("globex", "acme")):
        c = cluster.client(cluster.tokens.create(f"{me}-{role.value}", role, None, tenant=me))
        theirs = _calls(cluster.jobs[other], cluster.snaps[other])
        nobodys = _calls("job-nobody", "job-nobody-s1")
        for name, call in theirs.items():
            err = _error(call, c)
            if role is Role.VIEWER and name in NEEDS_OPERATE | {"DeleteSnapshot"}:
                assert isinstance(err, errors.PermissionDenied), (name, err)
                continue
            # Exactly what an id nobody has gets: nothing tells the other tenant's ids exist.
            ghost = _error(nobodys[name], c)
            assert err is not None and ghost is not None, (name, err, ghost)
            assert (type(err), err.cause.replace(cluster.snaps[other], "SID")
                    .replace(cluster.jobs[other], "ID")) == (
                type(ghost), ghost.cause.replace("job-nobody-s1", "SID")
                .replace("job-nobody", "ID")), (name, err, ghost)  # fmt: skip
            assert isinstance(err, (errors.JobNotFound, errors.SnapshotNotFound)), (name, err)
        # Listings hold only its own.
        assert [j.job_id for j in c.stub.Jobs(common_pb2.Empty(), timeout=30).jobs] == [
            cluster.jobs[me]]  # fmt: skip
        listed = c.stub.ListSnapshots(pb.ListSnapshotsRequest(), timeout=30).snapshots
        assert [s.snapshot_id for s in listed] == [cluster.snaps[me]]
        # Its own it sees.
        assert c.stub.Status(common_pb2.JobRef(job_id=cluster.jobs[me]), timeout=30).tenant == me
        shown = c.stub.ShowSnapshot(pb.SnapshotRef(snapshot_id=cluster.snaps[me]), timeout=30)
        assert shown.summary.tenant == me
        deadline = time.monotonic() + 60
        while "up" not in "".join(ch.data.decode() for ch in c.stub.Logs(
                common_pb2.LogsRequest(job_id=cluster.jobs[me]), timeout=30)):  # fmt: skip
            assert time.monotonic() < deadline, "its own job's log never showed"
            time.sleep(0.5)
        # Of tenants, only its own: another, or one nobody has, answers the same refusal.
        assert [t.tenant for t in c.stub.Tenants(common_pb2.Empty(), timeout=30).tenants] == [me]
        assert c.stub.ShowTenant(pb.TenantRef(tenant=me), timeout=30).jobs >= 1
        for who in (other, "nobody"):
            err = _error(lambda cl, w=who: cl.stub.ShowTenant(pb.TenantRef(tenant=w), timeout=30),
                         c)  # fmt: skip
            assert isinstance(err, errors.PermissionDenied), err
            assert err.cause.endswith(f"sees its own tenant {me!r} only"), err
        # The cluster is not a tenant's.
        for name, call in CLUSTER_CALLS.items():
            assert isinstance(_error(call, c), errors.PermissionDenied), name
        if role is Role.OPERATOR:
            with pytest.raises(errors.PermissionDenied, match="may not launch jobs of tenant"):
                c.stub.Run(pb.RunRequest(script="x.py", tenant=other), timeout=30)
            with pytest.raises(errors.InvalidArgument, match="is taken"):
                c.stub.Run(pb.RunRequest(script="x.py", job_id=cluster.jobs[other]), timeout=30)
            with pytest.raises(errors.InvalidArgument, match="is taken"):
                thaw = pb.ThawRequest(snapshot_id=cluster.snaps[me], job_id=cluster.jobs[other])
                list(c.stub.Thaw(thaw, timeout=30))


def test_a_tenants_operator_deletes_its_own_snapshots_only(cluster: Cluster) -> None:
    sid = cluster.plant("acme", f"{cluster.jobs['acme']}-s-del")
    ref = pb.SnapshotRef(snapshot_id=sid)
    acme_viewer = cluster.client(cluster.tokens.create("acme-dv", Role.VIEWER, None, tenant="acme"))
    globex = cluster.client(cluster.tokens.create("globex-d", Role.OPERATOR, None, tenant="globex"))
    cluster_op = cluster.client(cluster.tokens.create("ops-d", Role.OPERATOR, None))
    acme = cluster.client(cluster.tokens.create("acme-d", Role.OPERATOR, None, tenant="acme"))
    with pytest.raises(errors.PermissionDenied, match="needs the OPERATE right"):
        acme_viewer.stub.DeleteSnapshot(ref, timeout=30)
    with pytest.raises(errors.SnapshotNotFound):
        globex.stub.DeleteSnapshot(ref, timeout=30)
    # A cluster operator (no tenant) is not confined to a tenant, so the contract's right holds.
    with pytest.raises(errors.PermissionDenied, match="needs the ADMINISTER right"):
        cluster_op.stub.DeleteSnapshot(ref, timeout=30)
    assert sid in {s.snapshot_id for s in acme.stub.ListSnapshots(
        pb.ListSnapshotsRequest(), timeout=30).snapshots}  # fmt: skip
    acme.stub.DeleteSnapshot(ref, timeout=30)
    assert sid not in {s.snapshot_id for s in acme.stub.ListSnapshots(
        pb.ListSnapshotsRequest(), timeout=30).snapshots}  # fmt: skip
    with pytest.raises(errors.SnapshotNotFound):
        acme.stub.ShowSnapshot(ref, timeout=30)


def test_the_provider_sees_and_sets_every_tenant(cluster: Cluster) -> None:
    admin = cluster.client(cluster.tokens.create("provider-t", Role.ADMIN, None))
    try:
        info = admin.stub.SetTenant(pb.SetTenantRequest(
            tenant="globex", max_stored_bytes=50 << 30, max_concurrent_freezes=2,
            webhook_url="https://hooks.example.test/globex"), timeout=30)  # fmt: skip
        assert (info.max_stored_bytes, info.max_concurrent_freezes) == (50 << 30, 2)
        assert info.webhook_url == "https://hooks.example.test/globex"
        assert len(info.webhook_secret) >= 32  # shown once, here
        assert cluster.coord.limits.get("globex") == Limits(50 << 30, 2)
        # A field left out stays; -1 lifts a limit; "" removes the webhook.
        info = admin.stub.SetTenant(pb.SetTenantRequest(tenant="globex", max_stored_bytes=-1,
                                                        webhook_url=""), timeout=30)  # fmt: skip
        assert not info.HasField("max_stored_bytes") and info.max_concurrent_freezes == 2
        assert info.webhook_url == "" and info.webhook_secret == ""
        key_id = cluster.coord.data_keys.current("acme").key_id  # made by a first sealed freeze
        listed = {t.tenant: t for t in admin.stub.Tenants(common_pb2.Empty(), timeout=30).tenants}
        assert {"acme", "globex"} <= set(listed)
        acme = listed["acme"]
        assert acme.jobs >= 1 and acme.snapshots >= 1 and acme.stored_bytes > 0, acme
        assert acme.data_key_id == key_id != ""
        # A new tenant exists once a limit names it.
        admin.stub.SetTenant(pb.SetTenantRequest(tenant="initech", max_concurrent_freezes=1),
                             timeout=30)  # fmt: skip
        shown = admin.stub.ShowTenant(pb.TenantRef(tenant="initech"), timeout=30)
        assert (shown.jobs, shown.snapshots, shown.max_concurrent_freezes) == (0, 0, 1)
        for bad, match in ((pb.SetTenantRequest(tenant="../x"), "invalid tenant"),
                           (pb.SetTenantRequest(tenant="x", max_stored_bytes=-5), "-1 for"),
                           (pb.SetTenantRequest(tenant="x", webhook_url="http://10.0.0.1/"),
                            "not https")):  # fmt: skip
            with pytest.raises(errors.InvalidArgument, match=match):
                admin.stub.SetTenant(bad, timeout=30)
    finally:
        for t in ("globex", "initech"):
            cluster.coord.limits.set(t, Limits())


def test_quotas_and_consent_refuse_a_freeze_before_any_rank_is_touched(cluster: Cluster) -> None:
    acme = cluster.client(cluster.tokens.create("acme-q", Role.OPERATOR, None, tenant="acme"))
    admin = cluster.client(cluster.tokens.create("provider-q", Role.ADMIN, None))
    job = cluster.jobs["acme"]

    def freeze(c: Client, j: str = job) -> errors.SnapshotterError | None:
        return _error(lambda cl: list(cl.stub.Freeze(pb.FreezeRequest(job_id=j), timeout=60)), c)

    try:
        cluster.coord.limits.set("acme", Limits(max_stored_bytes=1))
        err = freeze(acme)
        assert isinstance(err, errors.FreezeRefused) and "its quota is 1" in err.cause, err
        assert "--max-stored" in err.next_step
        cluster.coord.limits.set("acme", Limits(max_concurrent_freezes=0))
        err = freeze(admin)
        assert isinstance(err, errors.FreezeRefused) and "its limit is 0" in err.cause, err
    finally:
        cluster.coord.limits.set("acme", Limits())
    assert cluster.coord.status(job).state == "RUNNING"
    # A job whose tenant withheld consent: the provider may not freeze it, the tenant may.
    st = acme.stub.Run(pb.RunRequest(
        script=str(cluster.script), python=sys.executable, cwd=str(cluster.script.parent),
        env={"PATH": "/usr/bin"}, provider_opt_out=True), timeout=120)  # fmt: skip
    err = freeze(admin, st.job_id)
    assert isinstance(err, errors.FreezeRefused) and "opted out" in err.cause, err
    assert freeze(acme, st.job_id) is None  # its tenant may (a plain process: CRIU alone)
    mine = acme.stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=st.job_id), timeout=30)
    assert [s.tenant for s in mine.snapshots] == ["acme"]
    admin.stub.Cancel(common_pb2.JobRef(job_id=st.job_id), timeout=60)


def test_the_provider_admin_acts_on_every_tenant_and_the_audit_log_has_it_all(
    cluster: Cluster,
) -> None:
    admin = cluster.client(cluster.tokens.create("provider", Role.ADMIN, None))
    jobs = {j.job_id: j.tenant for j in admin.stub.Jobs(common_pb2.Empty(), timeout=30).jobs}
    assert {jobs[cluster.jobs[t]] for t in ("acme", "globex")} == {"acme", "globex"}
    listed = admin.stub.ListSnapshots(pb.ListSnapshotsRequest(), timeout=30).snapshots
    assert {s.snapshot_id for s in listed} >= set(cluster.snaps.values())
    assert {s.tenant for s in listed} == {"acme", "globex"}
    assert admin.stub.Nodes(common_pb2.Empty(), timeout=30).nodes
    with pytest.raises(errors.InvalidArgument, match="tenant's token cannot have the admin"):
        cluster.tokens.create("x", Role.ADMIN, None, tenant="acme")
    # A tenant's operator ends its own job; the provider ends the other.
    acme = cluster.client(cluster.tokens.create("acme-end", Role.OPERATOR, None, tenant="acme"))
    acme.stub.Cancel(common_pb2.JobRef(job_id=cluster.jobs["acme"]), timeout=60)
    admin.stub.Cancel(common_pb2.JobRef(job_id=cluster.jobs["globex"]), timeout=60)
    for tenant in ("acme", "globex"):
        st = admin.stub.Wait(common_pb2.WaitRequest(job_id=cluster.jobs[tenant], timeout_s=60),
                             timeout=90)  # fmt: skip
        assert st.state == "CANCELLED", st
    lines = audit.read(cluster.audit_log)
    mine = [x for x in lines if x["method"] == "Cancel" and x["outcome"] == "ok"]
    assert {(x["who"], x["tenant"], x["target"]["job_id"]) for x in mine} >= {
        ("acme-end", "acme", cluster.jobs["acme"]), ("provider", None, cluster.jobs["globex"])}
    assert any(x["method"] == "Freeze" and x["outcome"] == "freeze_refused"
               and "opted out" in x["cause"] for x in lines)  # fmt: skip
    refused = [x for x in lines if x["outcome"] == "permission_denied"]
    assert any(x["method"] == "Nodes" and x["tenant"] for x in refused)
    runs = [x for x in lines if x["method"] == "Run" and x["outcome"] == "ok"]
    assert {x["tenant"] for x in runs} >= {"acme", "globex"}
    # Reads are not recorded; no line carries a request's environment or script.
    assert not any(x["method"] in ("Status", "Jobs", "Logs") and x["outcome"] == "ok"
                   for x in lines)  # fmt: skip
    assert all(set(x["target"]) <= set(audit.TARGET_FIELDS) for x in lines)
    assert time.time() - lines[-1]["time"] < 300
