"""The coordinator's gRPC surface (snapshotter.v1.Coordinator): requests in, Coordinator calls,
replies out. The checks every call passes (version, identity, right) are in
snapshotter/rpc/server.py; every decision is in core.py and its parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from snapshotter import errors
from snapshotter.coordinator import drain, migrate, reroute, snapshots, supervisor
from snapshotter.coordinator.core import Coordinator
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
        return self.c.nodes()

    def RegisterAgent(self, req: pb.RegisterAgentRequest, ctx: Any) -> pb.RegisterAgentReply:
        return self.c.register_agent(req)

    def Run(self, req: pb.RunRequest, ctx: Any) -> pb.JobStatus:
        return self.c.run(req)

    def Status(self, req: common_pb2.JobRef, ctx: Any) -> pb.JobStatus:
        return self.c.status(req.job_id)

    def Jobs(self, req: common_pb2.Empty, ctx: Any) -> pb.JobList:
        return self.c.jobs()

    def Wait(self, req: common_pb2.WaitRequest, ctx: Any) -> pb.JobStatus:
        if req.timeout_s < 0:
            raise errors.InvalidArgument("a negative wait", "pass --timeout SECONDS >= 0")
        return self.c.wait(req.job_id, req.timeout_s or 30.0)

    def Cancel(self, req: common_pb2.JobRef, ctx: Any) -> pb.JobStatus:
        return self.c.cancel(req.job_id)

    def Logs(self, req: common_pb2.LogsRequest, ctx: Any) -> Iterator[common_pb2.LogChunk]:
        return self.c.logs(req)

    def Events(self, req: common_pb2.JobRef, ctx: Any) -> pb.EventList:
        return self.c.events(req.job_id)

    def SetPolicy(self, req: pb.SetPolicyRequest, ctx: Any) -> pb.PolicyInfo:
        return supervisor.set_policy(self.c, req)

    def ShowPolicy(self, req: common_pb2.JobRef, ctx: Any) -> pb.PolicyInfo:
        return supervisor.show_policy(self.c, req.job_id)

    def Drain(self, req: pb.DrainRequest, ctx: Any) -> pb.DrainReply:
        return drain.drain_node(self.c, req)

    def DrainSelf(self, req: pb.DrainRequest, ctx: Any) -> pb.DrainReply:
        return drain.drain_self(self.c, req)

    def Freeze(self, req: pb.FreezeRequest, ctx: Any) -> Iterator[pb.FreezeEvent]:
        return self.c.freeze(req)

    def Thaw(self, req: pb.ThawRequest, ctx: Any) -> Iterator[pb.ThawEvent]:
        return self.c.thaw(req)

    def Migrate(self, req: pb.MigrateRequest, ctx: Any) -> Iterator[pb.MigrateEvent]:
        return migrate.migrate(self.c, req)

    def Link(self, req: pb.LinkRequest, ctx: Any) -> pb.LinkReply:
        return reroute.link(self.c, req)

    def ListSnapshots(self, req: pb.ListSnapshotsRequest, ctx: Any) -> pb.SnapshotList:
        return snapshots.list_snapshots(self.c.store, req.job_id)

    def ShowSnapshot(self, req: pb.SnapshotRef, ctx: Any) -> pb.SnapshotDetail:
        return snapshots.show(self.c.store, req.snapshot_id)

    def DeleteSnapshot(self, req: pb.SnapshotRef, ctx: Any) -> pb.DeleteReply:
        return snapshots.delete(self.c.store, req.snapshot_id)

    def Gc(self, req: pb.GcRequest, ctx: Any) -> pb.GcReport:
        return snapshots.gc(self.c.store, set(self.c.writing), time.time(), req)

    def Shutdown(self, req: pb.ShutdownRequest, ctx: Any) -> pb.ShutdownReply:
        return self.shutdown(req.force)


def register(c: Coordinator, shutdown: Shutdown = _refuse_shutdown) -> Any:
    """What rpc.server.serve calls to add this service to a server."""
    service = CoordinatorService(c, shutdown)
    return lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
