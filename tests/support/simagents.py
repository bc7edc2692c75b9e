"""Thousands of simulated node agents for the coordinator's scale tests (issue 17 part 4).

Each simulated agent serves the real generated Agent service (agent_pb2_grpc) on its own unix
socket and heartbeats the real coordinator service like `snapshotter agent` does
(RegisterAgent, heartbeat=True, every `heartbeat_s`); the coordinator reaches it through its
ordinary AgentHandle and client (coordinator/agents.py, rpc/client.py), nothing mocked there.

Hosting: every agent is its own grpc.aio server, many of them in one asyncio loop per host
process. aio servers share one completion queue and poller per process, so 1,024 of them cost
one process, a handful of threads and no CPU while idle (a sync grpc.server per agent would
cost a polling thread each). A server cannot tell which of its ports a call came in on (the
call's :authority is "localhost" on every unix socket), hence a server per agent.

The data phases are instant: Dump reports its ranks, Upload one empty stream per node, so the
coordinator commits a real (tiny, signed) manifest to the store; a thaw of it fetches and
restores at once, each node checking it was given its own stream and ranks. Every rank keeps
the order of the phases it went through and refuses a phase out of order
(FAILED_PRECONDITION), so a coordinator that skipped or reordered a phase fails the freeze and
the check of `Report`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory

from snapshotter import __version__, errors
from snapshotter.rpc import control, relay, status
from snapshotter.rpc.wire import PEER_KEY, VERSION_KEY
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2, coordinator_pb2_grpc
from snapshotter.v1 import coordinator_pb2 as cpb

ROOT = Path(__file__).resolve().parents[2]
# The phases of one freeze as a rank must see them; FinishFreeze ends it ("finish").
PHASES = ("prepare", "park", "suspend", "dump", "resume", "upload", "finish")


# The phase each state accepts next, and the state it leads to.
_NEXT = {p: PHASES[i + 1] if i + 1 < len(PHASES) else PHASES[0] for i, p in enumerate(PHASES)}


@dataclass
class SimRank:
    """A simulated rank's place in freezes: the next phase it accepts, and what it went through.

        prepare -> park -> suspend -> dump -> resume -> upload -> finish -> prepare (next freeze)
    Any other phase is refused (and recorded): a coordinator that skips, repeats or reorders
    a phase fails the freeze and the test's check of every rank's history.
    """

    rank: int
    phase: str = "prepare"  # the next phase it accepts
    seen: list[str] = field(default_factory=list)

    def step(self, phase: str) -> str | None:
        """Take `phase`; the refusal's text when it is out of order."""
        if phase != self.phase:
            return f"rank {self.rank}: {phase} while it expects {self.phase}"
        self.seen.append(phase)
        self.phase = _NEXT[phase]
        return None

    def abort(self) -> str | None:
        """An unpark: taken after prepare or park (the next phase is park or suspend)."""
        if self.phase not in ("park", "suspend"):
            return f"rank {self.rank}: abort while it expects {self.phase}"
        self.seen.append("abort")
        self.phase = "prepare"
        return None


class SimAgent(agent_pb2_grpc.AgentServicer):
    """One node's agent: `nproc` ranks of at most one job, every phase instant."""

    def __init__(self, name: str, node_index: int, nproc: int) -> None:
        self.name = name
        self.nproc = nproc
        self.incarnation = f"sim-{os.getpid()}-{node_index}"
        self.job: agent_pb2.LaunchRequest | None = None
        self.ranks: list[SimRank] = []
        self.freeze_id = ""
        self.refused: list[str] = []
        self.calls: dict[str, int] = {}
        # Its ranks never park (a hang): Park reports each missing, as the real agent does.
        self.stuck = False
        # Relayed calls (snapshotter/rpc/relay.py), checked as the real agent checks them.
        self.trust = relay.Trust(name)
        self.relay_s: list[float] = []  # how long each Relay took to deliver and answer
        self.relayer = relay.Relayer(None)

    # ---- helpers ----------------------------------------------------------------------

    def _count(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1

    async def _step(self, ctx: Any, phase: str, job_id: str, freeze_id: str) -> None:
        """`phase` of this node's job and current freeze on every rank (an abort: each rank
        unparked); refused and recorded when out of order."""
        self._count(phase)
        why = None
        if self.job is None or job_id != self.job.spec.job_id:
            why = f"{self.name}: {phase} of unknown job {job_id}"
        elif phase == "prepare":
            self.freeze_id = freeze_id
        elif freeze_id != self.freeze_id:
            why = f"{self.name}: {phase} of freeze {freeze_id}, not {self.freeze_id}"
        for r in self.ranks if why is None else ():
            why = r.abort() if phase == "abort" else r.step(phase)
            if why:
                break
        if why:
            self.refused.append(why)
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, why)

    def _node_job(self, with_spec: bool = False) -> agent_pb2.NodeJob:
        assert self.job is not None
        j = agent_pb2.NodeJob(job_id=self.job.spec.job_id, node_rank=self.job.node_rank,
                              state="RUNNING", node=self.name, started=1.0,
                              ranks=[common_pb2.RankState(rank=r.rank, local_rank=i, pid=1)
                                     for i, r in enumerate(self.ranks)])  # fmt: skip
        if with_spec:
            j.spec.CopyFrom(self.job.spec)
        return j

    def _records(self) -> list[common_pb2.RankRecord]:
        assert self.job is not None
        return [common_pb2.RankRecord(rank=r.rank, local_rank=i, node_rank=self.job.node_rank,
                                      stream=self.name, image_bytes=1)
                for i, r in enumerate(self.ranks)]  # fmt: skip

    # ---- the Agent service ------------------------------------------------------------

    async def Ping(self, req: Any, ctx: Any) -> common_pb2.AgentInfo:
        self._count("ping")
        return common_pb2.AgentInfo(node=self.name, version=__version__, pid=os.getpid(),
                                    incarnation=self.incarnation, cpus=self.nproc)  # fmt: skip

    async def Jobs(self, req: Any, ctx: Any) -> agent_pb2.NodeJobList:
        self._count("jobs")
        return agent_pb2.NodeJobList(jobs=[self._node_job(True)] if self.job else [])

    async def OpenRdzv(self, req: Any, ctx: Any) -> common_pb2.Endpoint:
        return common_pb2.Endpoint(host="127.0.0.1", port=29400)

    async def CloseRdzv(self, req: Any, ctx: Any) -> common_pb2.Empty:
        return common_pb2.Empty()

    async def Launch(self, req: agent_pb2.LaunchRequest, ctx: Any) -> agent_pb2.NodeJob:
        self._count("launch")
        self.job = req
        n = req.spec.nproc_per_node
        self.ranks = [SimRank(req.node_rank * n + i) for i in range(n)]
        return self._node_job()

    async def Status(self, req: common_pb2.JobRef, ctx: Any) -> agent_pb2.NodeJob:
        self._count("status")
        if self.job is None or req.job_id != self.job.spec.job_id:
            await ctx.abort(grpc.StatusCode.NOT_FOUND, f"job {req.job_id} is not on {self.name}")
        return self._node_job()

    async def Cancel(self, req: common_pb2.JobRef, ctx: Any) -> agent_pb2.NodeJob:
        self._count("cancel")
        j = agent_pb2.NodeJob(job_id=req.job_id, state="CANCELLED", node=self.name)
        self.job = None
        return j

    async def Prepare(self, req: agent_pb2.PrepareRequest, ctx: Any) -> agent_pb2.PrepareReply:
        await self._step(ctx, "prepare", req.job_id, req.freeze_id)
        return agent_pb2.PrepareReply(counts={r.rank: agent_pb2.GroupCounts(issued={"g0": 100})
                                              for r in self.ranks})  # fmt: skip

    async def Park(self, req: agent_pb2.ParkRequest, ctx: Any) -> agent_pb2.ParkReply:
        await self._step(ctx, "park", req.job_id, req.freeze_id)
        seq = req.targets.get("g0", 0)
        if self.stuck:
            # What agent/unparked.py makes of a rank waiting for a peer, threads and all.
            why = (f"did not answer 'parked' within {req.timeout_s:.0f}s; its barrier is "
                   f"armed; no group behind the others; a collective in flight for 58s; "
                   "threads: " + " | ".join(f"t{i}: gate.py:{i} wait < train.py:9 step"
                                             for i in range(12)))  # fmt: skip
            return agent_pb2.ParkReply(missing={r.rank: f"rank {r.rank} {why}"
                                                for r in self.ranks})  # fmt: skip
        return agent_pb2.ParkReply(parked={r.rank: agent_pb2.ParkPoint(group="g0", seq=seq)
                                           for r in self.ranks})  # fmt: skip

    async def Suspend(self, req: agent_pb2.PhaseRequest, ctx: Any) -> common_pb2.Empty:
        await self._step(ctx, "suspend", req.job_id, req.freeze_id)
        return common_pb2.Empty()

    async def Dump(self, req: agent_pb2.FreezeRef, ctx: Any) -> agent_pb2.DumpReply:
        await self._step(ctx, "dump", req.job_id, req.freeze_id)
        return agent_pb2.DumpReply(ranks=self._records())

    async def Resume(self, req: agent_pb2.PhaseRequest, ctx: Any) -> common_pb2.Empty:
        await self._step(ctx, "resume", req.job_id, req.freeze_id)
        return common_pb2.Empty()

    async def Upload(self, req: agent_pb2.UploadRequest, ctx: Any) -> Any:
        await self._step(ctx, "upload", req.job_id, req.freeze_id)
        now = time.time()
        # One empty stream per node: the manifest is real, with nothing in the store to check.
        yield agent_pb2.UploadEvent(uploaded=agent_pb2.Uploaded(
            streams={self.name: common_pb2.StreamInfo(name=self.name, chunk_size=1 << 20)},
            ranks=self._records(),
            upload=common_pb2.UploadWindow(node=self.name, start=now, end=now),
        ))  # fmt: skip

    async def FinishFreeze(self, req: agent_pb2.FinishFreezeRequest, ctx: Any) -> Any:
        if not req.committed:
            self.refused.append(f"{self.name}: FinishFreeze without a commit")
        await self._step(ctx, "finish", req.job_id, req.freeze_id)
        return self._node_job()

    async def KeepFreeze(self, req: agent_pb2.FreezeRef, ctx: Any) -> Any:
        self._count("keep")
        return agent_pb2.KeepFreezeReply(known=req.freeze_id == self.freeze_id)

    async def Abort(self, req: agent_pb2.FreezeRef, ctx: Any) -> agent_pb2.AbortReply:
        """Every rank unparked (only a freeze that failed does this: the ranks' histories
        show it)."""
        await self._step(ctx, "abort", req.job_id, req.freeze_id)
        return agent_pb2.AbortReply()

    async def DiscardUpload(self, req: agent_pb2.FreezeRef, ctx: Any) -> common_pb2.Empty:
        self._count("discard")
        return common_pb2.Empty()

    async def SetPolicy(self, req: agent_pb2.JobPolicy, ctx: Any) -> agent_pb2.NodeJob:
        return self._node_job()

    # ---- a thaw: instant as well, but what each node is given is checked -------------

    async def Fetch(self, req: agent_pb2.FetchRequest, ctx: Any) -> Any:
        """This node's share of a committed snapshot: its ranks' streams, all the one it
        uploaded (each node one), with the checked manifest's digest."""
        self._count("fetch")
        why = None
        if set(req.streams) != {self.name} or len(req.streams) != self.nproc:
            why = f"{self.name}: asked to fetch streams {list(req.streams)[:3]}..., not its own"
        elif len(req.manifest_sha256) != 64:
            why = f"{self.name}: a fetch without the checked manifest's digest"
        if why:
            self.refused.append(why)
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        yield agent_pb2.FetchEvent(fetched=agent_pb2.Fetched(
            node=self.name, op=f"fetch-{self.name}-{req.snapshot_id}"))  # fmt: skip

    async def Restore(self, req: agent_pb2.RestoreRequest, ctx: Any) -> agent_pb2.RestoreReply:
        """The job restored here: this node's ranks (as it dumped them), under the op its
        fetch gave; they start a new history of phases."""
        self._count("restore")
        ranks = sorted(r.rank for r in req.ranks)
        n = req.spec.nproc_per_node
        why = None
        if not req.op.startswith(f"fetch-{self.name}-"):
            why = f"{self.name}: restore of op {req.op!r}, not one of its fetches"
        elif ranks != list(range(req.node_rank * n, (req.node_rank + 1) * n)) or any(
            r.stream != self.name for r in req.ranks
        ):
            why = f"{self.name}: node rank {req.node_rank} given ranks {ranks[:3]}..."
        elif not req.epoch or not req.rdzv.port:
            why = f"{self.name}: a restore without its thaw's epoch or rendezvous"
        if why:
            self.refused.append(why)
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        self.job = agent_pb2.LaunchRequest(spec=req.spec, node_rank=req.node_rank)
        self.ranks = [SimRank(r) for r in ranks]
        self.freeze_id = ""
        return agent_pb2.RestoreReply(node=self.name, job=self._node_job())

    async def DiscardFetch(self, req: agent_pb2.FetchRef, ctx: Any) -> common_pb2.Empty:
        self._count("discard_fetch")
        return common_pb2.Empty()

    async def _carry(self, name: str, raw: bytes) -> agent_pb2.ControlReply:
        """One unary call of this servicer by name, its reply or failure as a Control reply."""
        try:
            method = _SERVICE.methods_by_name[name]
            parse = message_factory.GetMessageClass(method.input_type).FromString
            reply = await getattr(self, name)(parse(raw), _Carried())
            return agent_pb2.ControlReply(reply=reply.SerializeToString())
        except Exception as e:  # noqa: BLE001 - goes back as the call's error
            return agent_pb2.ControlReply(error=status.error_detail(status.as_snapshotter_error(e)))

    async def Relay(self, req: agent_pb2.RelayRequest, ctx: Any) -> agent_pb2.RelayReply:
        """The real agent's relay (relay.Relayer: a Control stream to each target), here
        to the other simulated agents over their unix sockets."""
        self._count("relay")

        t0 = time.monotonic()
        try:
            return await self.relayer.relay_async(req)
        finally:
            self.relay_s.append(time.monotonic() - t0)

    async def Relayed(self, req: agent_pb2.RelayedCall, ctx: Any) -> agent_pb2.ControlReply:
        self._count("relayed")
        try:
            order = self.trust.admit(req.order, req.signature)
        except errors.SnapshotterError as e:
            self.refused.append(f"{self.name}: relayed call refused: {e.cause}")
            await ctx.abort(grpc.StatusCode.PERMISSION_DENIED, e.cause)
        return await self._carry(order.method, order.request)

    async def Control(self, requests: Any, ctx: Any) -> Any:
        """The real agent's Control stream (snapshotter/rpc/control.py) over this servicer:
        every carried call runs at once, its reply or its refusal goes back with its id."""
        self._count("control")
        await ctx.send_initial_metadata(((control.READY_KEY, "1"),))  # the caller then writes
        replies: asyncio.Queue[agent_pb2.ControlReply] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(req: agent_pb2.ControlRequest) -> None:
            rep = await self._carry(req.method, req.request)
            rep.id = req.id
            await replies.put(rep)

        async def read() -> None:
            async for req in requests:
                t = asyncio.create_task(one(req))
                running.add(t)
                t.add_done_callback(running.discard)

        reader = asyncio.create_task(read())
        try:
            while True:
                yield await replies.get()
        finally:
            reader.cancel()


_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"]


class _Carried:
    """A carried call's context: its refusal fails that call alone, not the stream."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise errors.FreezeRefused(f"{code.name}: {details}", "")


@dataclass(frozen=True)
class HostPlan:
    """What one host process serves: its agents' names and node indices."""

    names: tuple[str, ...]
    first: int
    nproc: int
    sock_dir: str
    coordinator: str  # "unix:PATH" of the coordinator service
    heartbeat_s: float


async def _host(plan: HostPlan) -> None:
    agents = [SimAgent(n, plan.first + i, plan.nproc) for i, n in enumerate(plan.names)]
    servers = []
    for a in agents:
        srv = grpc.aio.server()
        agent_pb2_grpc.add_AgentServicer_to_server(a, srv)
        srv.add_insecure_port(f"unix:{plan.sock_dir}/{a.name}.sock")
        await srv.start()
        servers.append(srv)
    channel = grpc.aio.insecure_channel(plan.coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    md = ((VERSION_KEY, __version__), (PEER_KEY, "agent"))
    beats = {a.name: 0 for a in agents}
    failed = {a.name: 0 for a in agents}
    asked = {a.name: 0.0 for a in agents}  # the interval the coordinator asked of each

    async def register(a: SimAgent) -> None:
        req = cpb.RegisterAgentRequest(name=a.name, address=f"unix:{plan.sock_dir}/{a.name}.sock",
                                       host="127.0.0.1", heartbeat=True, version=__version__,
                                       incarnation=a.incarnation)  # fmt: skip
        try:
            reply = await stub.RegisterAgent(req, timeout=30, metadata=md)
            beats[a.name] += 1
            asked[a.name] = reply.beat_s
            a.trust.learn(reply.relay_key)
        except grpc.RpcError:
            failed[a.name] += 1

    # First registrations a few at a time: each makes the coordinator open a channel and ask
    # the agent for its jobs (as a real agent's first heartbeat does).
    gate = asyncio.Semaphore(32)

    async def first(a: SimAgent) -> None:
        async with gate:
            await register(a)

    await asyncio.gather(*(first(a) for a in agents))
    _say({"ready": len(agents)})

    async def beat(i: int, a: SimAgent) -> None:
        # Spread evenly over the interval, as independent agents' heartbeats are.
        await asyncio.sleep(plan.heartbeat_s * i / len(agents))
        while True:
            await register(a)
            await asyncio.sleep(max(plan.heartbeat_s, asked[a.name]))  # as daemon.py does

    tasks = [asyncio.create_task(beat(i, a)) for i, a in enumerate(agents)]
    loop = asyncio.get_running_loop()
    while True:
        cmd = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if cmd == "report":
            _say({a.name: {"ranks": {r.rank: list(r.seen) for r in a.ranks},
                           "refused": list(a.refused), "calls": dict(a.calls),
                           "beats": beats[a.name], "beat_failures": failed[a.name],
                           "relay_s": list(a.relay_s)}
                  for a in agents})  # fmt: skip
        elif cmd.startswith("stick"):
            stuck = set(cmd.partition(" ")[2].split(","))
            for a in agents:
                a.stuck = a.name in stuck
            _say({"stuck": sum(a.stuck for a in agents)})
        elif cmd in ("stop", ""):
            break
    for t in tasks:
        t.cancel()
    await channel.close()
    await asyncio.gather(*(s.stop(0) for s in servers))


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class SimHosts:
    """`agents` simulated agents of `nproc` ranks each, named sim0000..., in `procs` host
    processes (`python -m tests.support.simagents PLAN`, told what to do on stdin), registered
    with (and heartbeating) the coordinator at `coordinator`."""

    def __init__(self, agents: int, nproc: int, procs: int, sock_dir: str, coordinator: str,
                 heartbeat_s: float = 2.0, ready_s: float = 300.0) -> None:  # fmt: skip
        self.names = [f"sim{i:04d}" for i in range(agents)]
        self.procs: list[subprocess.Popen[str]] = []
        per = -(-agents // procs)
        try:
            for k in range(procs):
                names = self.names[k * per : (k + 1) * per]
                if not names:
                    continue
                plan = HostPlan(tuple(names), k * per, nproc, sock_dir, coordinator, heartbeat_s)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.support.simagents",
                     json.dumps(dataclasses.asdict(plan))],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                ))  # fmt: skip
            for p in self.procs:
                self._read(p, ready_s)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _read(p: subprocess.Popen[str], timeout: float) -> Any:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline() if ready else ""
        if not line:
            raise TimeoutError(
                f"simulated agent host {p.pid} did not answer within {timeout:.0f}s"
                f" (exit status {p.poll()})"
            )
        return json.loads(line)

    def report(self) -> dict[str, dict[str, Any]]:
        """Every agent's ranks' phases, refusals, calls taken and heartbeats sent."""
        out: dict[str, dict[str, Any]] = {}
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write("report\n")
            p.stdin.flush()
        for p in self.procs:
            for name, r in self._read(p, 60).items():
                r["ranks"] = {int(k): v for k, v in r["ranks"].items()}
                out[name] = r
        return out

    def stick(self, names: Sequence[str]) -> int:
        """Make the agents `names` hang (their ranks never park), and every other agent
        well again; how many are stuck."""
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"stick {','.join(names)}\n")
            p.stdin.flush()
        return sum(int(self._read(p, 60)["stuck"]) for p in self.procs)

    def pids(self) -> Sequence[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            try:
                assert p.stdin is not None
                p.stdin.write("stop\n")
                p.stdin.flush()
            except (OSError, ValueError):
                pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


if __name__ == "__main__":
    asyncio.run(
        _host(
            HostPlan(
                **{**json.loads(sys.argv[1]), "names": tuple(json.loads(sys.argv[1])["names"])}
            )
        )
    )
