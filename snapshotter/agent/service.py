"""The node agent's gRPC surface (snapshotter.v1.Agent): requests in, NodeAgent calls, replies
out. Every decision and effect is in the agent's parts (node.py); the checks every call passes
(version, identity, right) are in snapshotter/rpc/server.py, fencing here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from snapshotter import errors, metrics
from snapshotter.agent.fencing import Fence
from snapshotter.agent.node import NodeAgent
from snapshotter.launch.env import RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import auth, convert, relay
from snapshotter.rpc.wire import FENCE_KEY
from snapshotter.storage.sealing import Seal
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2

SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"].full_name

# What only the coordinator may call (the DRIVE right) is fenced: only the newest coordinator
# may make those calls (a restarted one always holds the newest token, also for Jobs, the
# first call it makes). The rights come from the .proto; no method is named here.
FENCED = frozenset(m for m, right in auth.method_rights().items() if right == auth.Right.DRIVE)


def fence_check(fence: Fence) -> Any:
    def check(method: str, metadata: Mapping[str, str]) -> None:
        if method in FENCED:
            fence.check(metadata.get(FENCE_KEY))

    return check


def _seal(m: agent_pb2.LaunchRequest | agent_pb2.RestoreRequest) -> Seal | None:
    """The data key for the job's application checkpoints, if the request carries one."""
    return convert.seal_of(m.seal) if m.HasField("seal") else None


def _rdzv(m: agent_pb2.LaunchRequest | agent_pb2.RestoreRequest) -> RdzvAddress | None:
    return RdzvAddress(m.rdzv.host, m.rdzv.port) if m.HasField("rdzv") else None


def _timeout(t: float, default: float) -> float:
    if t < 0:
        raise errors.InvalidArgument(f"timeout {t} must not be negative", "pass seconds >= 0")
    return t or default


class AgentService(agent_pb2_grpc.AgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.relayer = relay.Relayer(agent.settings.peer_tls)

    def Relay(self, req: agent_pb2.RelayRequest, ctx: Any) -> agent_pb2.RelayReply:
        return self.relayer.relay(req)

    def Relayed(self, req: agent_pb2.RelayedCall, ctx: Any) -> agent_pb2.ControlReply:
        # Served by rpc/server.py where the agent was given a relay.Trust; here only when not.
        raise errors.Unauthenticated(
            f"the agent of node {self.agent.settings.name} takes no relayed calls",
            "the coordinator calls it directly",
        )

    def Ping(self, req: common_pb2.Empty, ctx: Any) -> common_pb2.AgentInfo:
        return self.agent.info()

    def OpenRdzv(self, req: agent_pb2.OpenRdzvRequest, ctx: Any) -> common_pb2.Endpoint:
        addr = self.agent.rdzv.open(req.job_id, req.python, dict(req.env), spare=req.spare)
        return common_pb2.Endpoint(host=addr.host, port=addr.port)

    def CloseRdzv(self, req: common_pb2.JobRef, ctx: Any) -> common_pb2.Empty:
        self.agent.rdzv.close(req.job_id)
        return common_pb2.Empty()

    def Launch(self, req: agent_pb2.LaunchRequest, ctx: Any) -> agent_pb2.NodeJob:
        spec = JobSpec.from_proto(req.spec)
        self.agent.checkpoints.hold_key(spec.job_id, _seal(req))
        return self.agent.launcher.launch(spec, req.node_rank, _rdzv(req), req.plane).to_proto()

    def Prepare(self, req: agent_pb2.PrepareRequest, ctx: Any) -> agent_pb2.PrepareReply:
        return self.agent.freezes.prepare(req.job_id, req.freeze_id, _timeout(req.timeout_s, 30))

    def Park(self, req: agent_pb2.ParkRequest, ctx: Any) -> agent_pb2.ParkReply:
        return self.agent.freezes.park(
            req.job_id, req.freeze_id, dict(req.targets), _timeout(req.timeout_s, 60)
        )

    def Suspend(self, req: agent_pb2.PhaseRequest, ctx: Any) -> common_pb2.Empty:
        self.agent.freezes.suspend(req.job_id, req.freeze_id, _timeout(req.timeout_s, 60))
        return common_pb2.Empty()

    def Abort(self, req: agent_pb2.FreezeRef, ctx: Any) -> agent_pb2.AbortReply:
        return self.agent.freezes.abort(req.job_id, req.freeze_id)

    def KeepFreeze(self, req: agent_pb2.FreezeRef, ctx: Any) -> agent_pb2.KeepFreezeReply:
        return agent_pb2.KeepFreezeReply(known=self.agent.freezes.keep(req.freeze_id))

    def Dump(self, req: agent_pb2.FreezeRef, ctx: Any) -> agent_pb2.DumpReply:
        return self.agent.freezes.dump(req.job_id, req.freeze_id, set(req.ranks) or None)

    def Resume(self, req: agent_pb2.PhaseRequest, ctx: Any) -> common_pb2.Empty:
        if req.HasField("rdzv"):
            self.agent.move_rdzv(req.job_id, RdzvAddress(req.rdzv.host, req.rdzv.port))
        plane = req.plane if req.HasField("plane") else None
        self.agent.freezes.resume(req.job_id, req.freeze_id, _timeout(req.timeout_s, 120), plane,
                                  frozenset(req.skip_ranks))  # fmt: skip
        return common_pb2.Empty()

    def Upload(self, req: agent_pb2.UploadRequest, ctx: Any) -> Iterator[agent_pb2.UploadEvent]:
        seal = convert.seal_of(req.seal) if req.HasField("seal") else None
        return metrics.transfers("upload", self.agent.freezes.upload(
            req.job_id, req.freeze_id, req.snapshot_id, seal))

    def DiscardUpload(self, req: agent_pb2.FreezeRef, ctx: Any) -> common_pb2.Empty:
        self.agent.freezes.discard_upload(req.freeze_id)
        return common_pb2.Empty()

    def FinishFreeze(self, req: agent_pb2.FinishFreezeRequest, ctx: Any) -> agent_pb2.NodeJob:
        return self.agent.freezes.finish(
            req.job_id,
            req.freeze_id,
            req.stop,
            committed=req.committed,
            stop_ranks=frozenset(req.stop_ranks),
        ).to_proto()

    def Fetch(self, req: agent_pb2.FetchRequest, ctx: Any) -> Iterator[agent_pb2.FetchEvent]:
        uncommitted = {n: convert.plain(s) for n, s in req.uncommitted.items()}
        seal = convert.seal_of(req.seal) if req.HasField("seal") else None
        return metrics.transfers("fetch", self.agent.thaws.fetch(
            req.snapshot_id, list(req.streams), uncommitted or None, digest=req.manifest_sha256,
            seal=seal))

    def DiscardFetch(self, req: agent_pb2.FetchRef, ctx: Any) -> common_pb2.Empty:
        self.agent.thaws.discard(req.op)
        return common_pb2.Empty()

    def Restore(self, req: agent_pb2.RestoreRequest, ctx: Any) -> agent_pb2.RestoreReply:
        self.agent.checkpoints.hold_key(req.spec.job_id, _seal(req))
        return self.agent.thaws.restore(
            req.op, JobSpec.from_proto(req.spec), list(req.ranks), req.node_rank,
            _timeout(req.timeout_s, 120), _rdzv(req), req.epoch, req.put_back_files, req.plane,
        )  # fmt: skip

    def Bridge(self, req: agent_pb2.BridgeRequest, ctx: Any) -> common_pb2.Empty:
        routes = [(r.dst, r.via) for r in req.routes]
        self.agent.links.bridge(req.plane, routes, req.remove)
        return common_pb2.Empty()

    def OfferImages(self, req: agent_pb2.OfferRequest, ctx: Any) -> common_pb2.Empty:
        self.agent.freezes.offer(req.job_id, req.freeze_id, req.ticket)
        return common_pb2.Empty()

    def ReadImages(self, req: agent_pb2.ImagesRequest, ctx: Any) -> Iterator[agent_pb2.ImagePiece]:
        return self.agent.freezes.images(req.job_id, req.freeze_id, req.ticket, req.stream)

    def Receive(self, req: agent_pb2.ReceiveRequest, ctx: Any) -> Iterator[agent_pb2.FetchEvent]:
        return self.agent.thaws.receive(
            req.source, req.source_name, req.job_id, req.freeze_id, req.ticket,
            list(req.streams), req.bytes,
        )  # fmt: skip

    def Status(self, req: common_pb2.JobRef, ctx: Any) -> agent_pb2.NodeJob:
        return self.agent.status(req.job_id)

    def Progress(self, req: common_pb2.ProgressRequest, ctx: Any) -> common_pb2.JobProgress:
        return self.agent.progress(req.job_id, peers=req.peers)

    def Jobs(self, req: common_pb2.Empty, ctx: Any) -> agent_pb2.NodeJobList:
        return agent_pb2.NodeJobList(
            jobs=[j.to_proto(with_spec=True) for j in self.agent.jobs.all()]
        )

    def Wait(self, req: common_pb2.WaitRequest, ctx: Any) -> agent_pb2.NodeJob:
        return self.agent.wait(req.job_id, _timeout(req.timeout_s, 10)).to_proto()

    def Cancel(self, req: common_pb2.JobRef, ctx: Any) -> agent_pb2.NodeJob:
        job = self.agent.cancel(req.job_id)
        if job is None:
            return agent_pb2.NodeJob(job_id=req.job_id, state="CANCELLED")
        return job.to_proto()

    def SetPolicy(self, req: agent_pb2.JobPolicy, ctx: Any) -> agent_pb2.NodeJob:
        return self.agent.set_policy(req.job_id, req.policy).to_proto()

    def Logs(self, req: common_pb2.LogsRequest, ctx: Any) -> Iterator[common_pb2.LogChunk]:
        rank = req.rank if req.HasField("rank") else None
        return self.agent.logs(req.job_id, rank, req.offset, req.follow)

    def WeightsIndex(self, req: agent_pb2.WeightsRequest, ctx: Any) -> agent_pb2.WeightsIndexReply:
        return self.agent.weights.index_of(req)

    def ReadWeights(
        self, req: agent_pb2.WeightsRequest, ctx: Any
    ) -> Iterator[agent_pb2.WeightPiece]:
        return self.agent.weights.read(req)

    def AuditNode(self, req: agent_pb2.AuditNodeRequest, ctx: Any) -> agent_pb2.AuditNodeReply:
        return self.agent.audit_node(req)

    def OpenProbe(self, req: agent_pb2.OpenProbeRequest, ctx: Any) -> agent_pb2.ProbeEndpoint:
        return self.agent.open_probe(req)

    def ProbeLink(self, req: agent_pb2.ProbeLinkRequest, ctx: Any) -> agent_pb2.LinkMeasurement:
        return self.agent.probe_link(req)


def register(agent: NodeAgent) -> Any:
    """What rpc.server.serve calls to add this service to a server."""
    service = AgentService(agent)
    return lambda server: agent_pb2_grpc.add_AgentServicer_to_server(service, server)

