"""The coordinator's gRPC surface (snapshotter.v1.Coordinator): requests in, Coordinator calls,
replies out. The checks every call passes (version, identity, right) are in
snapshotter/rpc/server.py; every decision is in core.py and its parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from snapshotter import errors
from snapshotter.coordinator import (
    audit,
    drain,
    migrate,
    reroute,
    snapshots,
    supervisor,
    tenancy,
    tenants,
    top,
)
from snapshotter.coordinator.core import Coordinator
from snapshotter.coordinator.decisions import JobPhase
from snapshotter.rpc.server import caller
from snapshotter.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

pb = coordinator_pb2
SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name

# What Shutdown does: the embedded daemon stops itself; a standalone coordinator refuses.
Shutdown = Callable[[bool], pb.ShutdownReply]


def _refuse_shutdown(force: bool) -> pb.ShutdownReply:
    raise errors.InvalidArgument(
        "a standalone coordinator is stopped by its service manager, not by a client",
        "systemctl stop snapshotter-coordinator (or signal its process)",
    )


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, c: Coordinator, shutdown: Shutdown = _refuse_shutdown) -> None:
        self.c = c
        self.shutdown = shutdown

    def Ping(self, req: common_pb2.Empty, ctx: Any) -> pb.CoordinatorInfo:
        return self.c.ping()

    def Nodes(self, req: common_pb2.Empty, ctx: Any) -> pb.NodeList:
        tenancy.require_cluster_scope("list the nodes")
        return self.c.nodes()

    def RegisterAgent(self, req: pb.RegisterAgentRequest, ctx: Any) -> pb.RegisterAgentReply:
        return self.c.register_agent(req)

    def Run(self, req: pb.RunRequest, ctx: Any) -> pb.JobStatus:
        req.tenant = tenancy.launch_tenant(req.tenant)
        if req.job_id:
            tenancy.check_job_id_free(req.job_id, self._tenant_of(req.job_id))
        return self.c.run(req)

    def Status(self, req: common_pb2.JobRef, ctx: Any) -> pb.JobStatus:
        return self._own(self.c.status(req.job_id))

    def Jobs(self, req: common_pb2.Empty, ctx: Any) -> pb.JobList:
        listed = self.c.jobs()
        mine = tenancy.scope()
        if mine is None:
            return listed
        return pb.JobList(jobs=[j for j in listed.jobs if j.tenant == mine])

    def Wait(self, req: common_pb2.WaitRequest, ctx: Any) -> pb.JobStatus:
        if req.timeout_s < 0:
            raise errors.InvalidArgument("a negative wait", "pass --timeout SECONDS >= 0")
        self._check_job(req.job_id)
        return self.c.wait(req.job_id, req.timeout_s or 30.0)

    def Cancel(self, req: common_pb2.JobRef, ctx: Any) -> pb.JobStatus:
        self._check_job(req.job_id)
        return self.c.cancel(req.job_id)

    def Logs(self, req: common_pb2.LogsRequest, ctx: Any) -> Iterator[common_pb2.LogChunk]:
        self._check_job(req.job_id)
        return self.c.logs(req)

    def Events(self, req: common_pb2.JobRef, ctx: Any) -> pb.EventList:
        self._check_job(req.job_id)
        return self.c.events(req.job_id)

    def SetPolicy(self, req: pb.SetPolicyRequest, ctx: Any) -> pb.PolicyInfo:
        self._check_job(req.job_id)
        return supervisor.set_policy(self.c, req)

    def ShowPolicy(self, req: common_pb2.JobRef, ctx: Any) -> pb.PolicyInfo:
        self._check_job(req.job_id)
        return supervisor.show_policy(self.c, req.job_id)

    def Drain(self, req: pb.DrainRequest, ctx: Any) -> pb.DrainReply:
        tenancy.require_cluster_scope("drain a node")
        return drain.drain_node(self.c, req)

    def DrainSelf(self, req: pb.DrainRequest, ctx: Any) -> pb.DrainReply:
        return drain.drain_self(self.c, req)

    def AnnounceWeights(self, req: pb.AnnounceWeightsRequest, ctx: Any) -> common_pb2.Empty:
        return self.c.weights.announce(req)

    def WatchWeights(self, req: pb.WatchWeightsRequest, ctx: Any) -> pb.WeightsPlan:
        return self.c.weights.watch(req)

    def Weights(self, req: common_pb2.Empty, ctx: Any) -> pb.WeightsChannelList:
        return self.c.weights.listing(tenancy.scope())

    def Top(self, req: pb.TopRequest, ctx: Any) -> pb.TopReport:
        self._check_job(req.job_id)
        return top.run(self.c, req)

    def Audit(self, req: pb.AuditRequest, ctx: Any) -> pb.AuditReport:
        tenancy.require_cluster_scope("audit the cluster")
        return audit.run(self.c, req)

    def Freeze(self, req: pb.FreezeRequest, ctx: Any) -> Iterator[pb.FreezeEvent]:
        self._check_job(req.job_id)
        tenancy.check_provider_freeze(req.job_id, self.c.job(req.job_id).spec.provider_opt_out)
        return self._recorded_freeze(req, _asked_by())

    def Thaw(self, req: pb.ThawRequest, ctx: Any) -> Iterator[pb.ThawEvent]:
        self._check_snapshot(req.snapshot_id)
        if req.job_id:
            tenancy.check_job_id_free(req.job_id, self._tenant_of(req.job_id))
        return self._recorded_thaw(req, _asked_by())

    def Migrate(self, req: pb.MigrateRequest, ctx: Any) -> Iterator[pb.MigrateEvent]:
        self._check_job(req.job_id)
        return migrate.migrate(self.c, req)

    def Link(self, req: pb.LinkRequest, ctx: Any) -> pb.LinkReply:
        tenancy.require_cluster_scope("manage data links")
        return reroute.link(self.c, req)

    def ListSnapshots(self, req: pb.ListSnapshotsRequest, ctx: Any) -> pb.SnapshotList:
        listed = snapshots.list_snapshots(self.c.store, req.job_id)
        mine = tenancy.scope()
        if mine is None:
            return listed
        return pb.SnapshotList(snapshots=[s for s in listed.snapshots if s.tenant == mine])

    def ShowSnapshot(self, req: pb.SnapshotRef, ctx: Any) -> pb.SnapshotDetail:
        detail = snapshots.show(self.c.store, req.snapshot_id)
        tenancy.check_snapshot(req.snapshot_id, detail.summary.tenant, self.c.store.describe())
        return detail

    def DeleteSnapshot(self, req: pb.SnapshotRef, ctx: Any) -> pb.DeleteReply:
        self._check_snapshot(req.snapshot_id)
        return snapshots.delete(self.c.store, req.snapshot_id)

    def Tenants(self, req: common_pb2.Empty, ctx: Any) -> pb.TenantList:
        # One look at the jobs (every agent answers) and the store (every manifest) for all.
        jobs, snaps = self._holdings()
        mine = tenancy.scope()
        if mine is not None:
            return pb.TenantList(tenants=[self._tenant(mine, jobs, snaps)])
        names = {t for t, _, _ in jobs} | {t for t, _ in snaps} | set(self.c.limits.all())
        if self.c.webhooks is not None:
            names |= set(self.c.webhooks.config.all())
        return pb.TenantList(tenants=[self._tenant(t, jobs, snaps)
                                      for t in sorted(names - {""})])  # fmt: skip

    def ShowTenant(self, req: pb.TenantRef, ctx: Any) -> pb.TenantInfo:
        tenancy.check_tenant(tenants.check_name(req.tenant))
        return self._tenant(req.tenant, *self._holdings())

    def SetTenant(self, req: pb.SetTenantRequest, ctx: Any) -> pb.TenantInfo:
        tenancy.require_cluster_scope("change a tenant's limits or webhook")
        tenant = tenants.check_name(req.tenant)
        limits = tenants.new_limits(self.c.limits.get(tenant), req)
        secret = None
        if req.HasField("webhook_url"):
            url = tenants.new_webhook_url(req)
            if self.c.webhooks is None:
                raise errors.InvalidArgument("this coordinator sends no webhooks",
                                             "run the coordinator with webhooks on")  # fmt: skip
            secret = self.c.webhooks.config.set(tenant, url)
        self.c.limits.set(tenant, limits)
        info = self._tenant(tenant, *self._holdings())
        if secret is not None:
            info.webhook_secret = secret
        return info

    def _holdings(self) -> tuple[list[tuple[str, bool, bool]], list[tuple[str, int]]]:
        """(tenant, active, freezing) of every job; (tenant, stored bytes) of every snapshot."""
        jobs = [(j.tenant, not JobPhase(j.state).terminal, j.state == JobPhase.FREEZING.value)
                for j in self.c.jobs().jobs]  # fmt: skip
        snaps = [(s.tenant, s.stored_bytes)
                 for s in snapshots.list_snapshots(self.c.store, "").snapshots]  # fmt: skip
        return jobs, snaps

    def _tenant(self, tenant: str, jobs: list[tuple[str, bool, bool]],
                snaps: list[tuple[str, int]]) -> pb.TenantInfo:  # fmt: skip
        hook = None if self.c.webhooks is None else self.c.webhooks.config.get(tenant)
        held = tenants.tally(tenant, jobs, snaps)
        return tenants.describe(tenant, self.c.limits.get(tenant), held, hook.url if hook else None,
                                self.c.data_keys.current_id(tenant))  # fmt: skip

    def Gc(self, req: pb.GcRequest, ctx: Any) -> pb.GcReport:
        return snapshots.gc(self.c.store, set(self.c.writing), time.time(), req)

    def Shutdown(self, req: pb.ShutdownRequest, ctx: Any) -> pb.ShutdownReply:
        return self.shutdown(req.force)

    # ---- what a person asked for, in the job's events (and so its tenant's webhook) -----
    # The supervisor's own freezes and thaws record theirs (policy snapshots, recoveries).

    def _recorded_freeze(self, req: pb.FreezeRequest, who: str) -> Iterator[pb.FreezeEvent]:
        t0 = time.monotonic()
        try:
            for ev in self.c.freeze(req):
                if ev.HasField("done"):
                    stopped = ", the job stopped" if req.stop else ""
                    self._event(req.job_id, "frozen", snapshot_id=ev.done.snapshot_id,
                                took_s=time.monotonic() - t0,
                                detail=f"asked by {who}{stopped}")  # fmt: skip
                yield ev
        except errors.SnapshotterError as e:
            # A finished job's history is closed (nothing more is written to the store for
            # it): refusing to freeze it is the caller's answer only.
            if not self._ended(req.job_id):
                self._event(req.job_id, "freeze_failed", cause=e.code,
                            detail=f"asked by {who}: {e.cause}")  # fmt: skip
            raise

    def _recorded_thaw(self, req: pb.ThawRequest, who: str) -> Iterator[pb.ThawEvent]:
        t0 = time.monotonic()
        for ev in self.c.thaw(req):
            if ev.HasField("done"):
                self._event(ev.done.job_id, "thawed", snapshot_id=req.snapshot_id,
                            took_s=time.monotonic() - t0, detail=f"asked by {who}")  # fmt: skip
            yield ev

    def _ended(self, job_id: str) -> bool:
        try:
            return self.c.job(job_id).ended is not None
        except errors.JobNotFound:
            return True

    def _event(self, job_id: str, kind: str, **kw: Any) -> None:
        try:
            rec = self.c.job(job_id)
        except errors.JobNotFound:
            return  # cancelled meanwhile: nothing left to tell
        rec.life.add(kind, nodes=list(rec.nodes), **kw)

    # ---- tenants (tenancy.py decides) --------------------------------------------------

    def _tenant_of(self, job_id: str) -> str | None:
        # The record's spec, not a status: a status asks every node of the job.
        try:
            return self.c.job(job_id).spec.tenant
        except errors.JobNotFound:
            return None

    def _check_job(self, job_id: str) -> None:
        if tenancy.scope() is not None:
            tenancy.check_job(job_id, self._tenant_of(job_id))

    def _own(self, st: pb.JobStatus) -> pb.JobStatus:
        tenancy.check_job(st.job_id, st.tenant)
        return st

    def _check_snapshot(self, snapshot_id: str) -> None:
        if tenancy.scope() is not None:
            tenant = snapshots.show(self.c.store, snapshot_id).summary.tenant
            tenancy.check_snapshot(snapshot_id, tenant, self.c.store.describe())


def _asked_by() -> str:
    who = caller()
    return "root" if who is None else who.name


def register(c: Coordinator, shutdown: Shutdown = _refuse_shutdown) -> Any:
    """What rpc.server.serve calls to add this service to a server."""
    service = CoordinatorService(c, shutdown)
    return lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
