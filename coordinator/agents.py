"""The node agents as the coordinator sees them: a typed client per agent, one call on many
agents at once (every phase of a freeze or thaw is parallel across nodes), and many streams
merged into one.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from snapshotter import errors, parallel
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import control, relay, status
from snapshotter.rpc.aio import LOOP, AioClient
from snapshotter.rpc.client import Client, Target, agent_client
from snapshotter.rpc.relay import Signer
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2

R = TypeVar("R")
# How long a replaced agent's channel stays open for calls already made on it.
RETIRE_S = 600.0


@dataclass
class AgentHandle:
    name: str
    address: str
    host: str
    # How to reach it: address, TLS (its certificate carries its name), the fencing token.
    target: Target
    # time.monotonic() of the agent's last registration heartbeat (None: never expires).
    seen: float | None = None
    # The heartbeat interval the coordinator last asked of it (decisions.beat_interval).
    beat_s: float = 0.0
    # Changes when the agent process restarts (its jobs are then gone or orphaned).
    incarnation: str = ""
    version: str = ""
    # Its data links in plane order, as its last heartbeat reported them (agent/links.py).
    links: list[common_pb2.LinkState] = field(default_factory=list)
    # The key of the coordinator that registered it (rpc/relay.py): fan-outs over agents
    # sharing one may go through relays.
    relay: Signer | None = None
    client: Client = field(init=False)
    # The same agent through the process's event loop: what `call_all` fans out on.
    aio: AioClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = agent_client(self.target)
        self.aio = AioClient(self.target, agent_pb2_grpc.AgentStub, "coordinator", "agent",
                             agent_pb2.DESCRIPTOR.services_by_name["Agent"])  # fmt: skip

    @property
    def stub(self) -> Any:
        """The generated AgentStub: every call carries our version, credentials and fence."""
        return self.client.stub

    def close(self) -> None:
        """Close the channels (the agent was replaced or forgotten; calls on them fail)."""
        self.client.close()
        self.aio.close()

    def retire(self, after_s: float = RETIRE_S) -> None:
        """Close the channel later: an operation may still be calling the old incarnation
        from another thread, and grpc closing a channel under a call in flight can crash
        the process (seen here: a segfault in cygrpc when an agent restarted mid-upload).
        Its Control stream ends now (a call made on it meanwhile is a call of its own)."""
        self.aio.end_stream()
        t = threading.Timer(after_s, self.close)
        t.daemon = True
        t.start()


def on_all(
    agents: Iterable[AgentHandle],
    fn: Callable[[AgentHandle], R],
    first_failure: Callable[[AgentHandle, BaseException], None] | None = None,
) -> parallel.Outcome[str, R]:
    """`fn` on every agent at once; results and failures by agent name (`first_failure`: as
    `parallel.each`)."""
    return parallel.each(agents, fn, key=lambda a: a.name, first_failure=first_failure,
                         name="agents")  # fmt: skip


def call_all(
    agents: Iterable[AgentHandle],
    method: str,
    request: Any,
    timeout: float | None,
    *,
    started: Callable[[AgentHandle], None] | None = None,
    ended: Callable[[AgentHandle, float, float], None] | None = None,
    first_failure: Callable[[AgentHandle, BaseException], None] | None = None,
) -> parallel.Outcome[str, Any]:
    """The unary `method` (e.g. "Park") on every agent at once, on the process's event loop
    rather than a thread per agent (rpc/aio.py: at 2,048 agents the threads were most of a
    phase's cost); results and failures by agent name, in the agents' order. `request`: the
    same message for all, or a function making each agent's. `started(agent)` and
    `ended(agent, start, end)` (wall-clock times) run on the loop's thread as each call starts
    and ends: keep them short. `first_failure(agent, error)` runs once, as soon as the first
    call fails, while the others may still run (as `parallel.each`'s): on a thread of its
    own, since it may block (a thaw cancels the other nodes' restores), and call_all returns
    only after it did."""
    todo = list(agents)
    out: parallel.Outcome[str, Any] = parallel.Outcome()
    if not todo:
        return out
    hook: list[asyncio.Future[None]] = []

    async def one(a: AgentHandle) -> Any:
        if started is not None:
            started(a)
        t0 = time.time()
        try:
            req = request(a) if callable(request) else request
            return await a.aio.call(method, req, timeout)
        except Exception as e:
            if first_failure is not None and not hook:
                hook.append(asyncio.get_running_loop().run_in_executor(
                    parallel.CACHED, first_failure, a, e))  # fmt: skip
            raise
        finally:
            if ended is not None:
                ended(a, t0, time.time())

    async def every() -> list[Any]:
        got = await asyncio.gather(*(one(a) for a in todo), return_exceptions=True)
        if hook:
            await asyncio.gather(*hook, return_exceptions=True)  # its own failure is its own
        return got

    signer = todo[0].relay
    relayed = (
        signer is not None and timeout is not None and not callable(request)
        and first_failure is None
        and method in relay.RELAYED and len(todo) >= relay.min_agents()
        and all(a.relay is signer for a in todo)
    )  # fmt: skip
    if relayed:
        assert signer is not None and timeout is not None
        coro = _via_relays(todo, signer, method, request, timeout, started, ended)
    else:
        coro = every()
    for a, r in zip(todo, LOOP.run(coro), strict=True):
        if isinstance(r, BaseException):
            out.failures[a.name] = r
        else:
            out.results[a.name] = r
    return out


# How much longer than a relayed call's own deadline the coordinator waits for its relay.
RELAY_SLACK_S = 10.0
# Agents whose Relay failed lately, until when: another member relays for their group
# meanwhile (a silent relay holds its whole group up to the phase's deadline).
_SUSPECT: dict[str, float] = {}
SUSPECT_S = 120.0


def _head(members: list[AgentHandle]) -> AgentHandle:
    """The member that relays for its group: the first whose relay has not failed lately.
    Always the same one otherwise, so that each node holds a stream from one relay."""
    now = time.monotonic()
    return next((m for m in members if _SUSPECT.get(m.name, 0.0) <= now), members[0])


async def _via_relays(
    todo: list[AgentHandle],
    signer: Signer,
    method: str,
    request: Any,
    timeout: float,
    started: Callable[[AgentHandle], None] | None,
    ended: Callable[[AgentHandle, float, float], None] | None,
) -> list[Any]:
    """call_all's fan-out as a tree (rpc/relay.py): one signed order per group of about
    sqrt(N) agents, handed to the group's first agent; each member's outcome (its reply or
    its exception) in `todo`'s order. A member the relay did not deliver to, or every member
    of a group whose relay failed, is called directly."""
    raw = request.SerializeToString()
    reply_type = control.reply_class(agent_pb2.DESCRIPTOR.services_by_name["Agent"], method)
    out: list[Any] = [None] * len(todo)

    async def direct(i: int) -> None:
        try:
            out[i] = await todo[i].aio.call(method, request, timeout)
        except Exception as e:  # noqa: BLE001 - the member's outcome
            out[i] = e

    async def group(members: range) -> None:
        head = _head([todo[i] for i in members])
        fence = head.target.fence
        order, sig = signer.sign(method, raw, timeout,
                                 f"{fence[0]}:{fence[1]}" if fence is not None else "",
                                 [todo[i].name for i in members])  # fmt: skip
        req = agent_pb2.RelayRequest(order=order, signature=sig, targets=[
            agent_pb2.RelayTarget(name=todo[i].name, address=todo[i].address) for i in members
        ])  # fmt: skip
        t0 = time.time()
        for i in members:
            if started is not None:
                started(todo[i])
        try:
            rep = await head.aio.call("Relay", req, timeout + RELAY_SLACK_S)
            by_name = {r.name: r for r in rep.results}
        except Exception:  # noqa: BLE001 - every member is called directly (below)
            # A member the relay reached may see the call twice: the agents' phases refuse
            # a repeat (their freeze's state machine), and a Resume must reach every member.
            now = time.monotonic()
            if len(_SUSPECT) > 4096:
                for name in [n for n, until in _SUSPECT.items() if until <= now]:
                    del _SUSPECT[name]
            _SUSPECT[head.name] = now + SUSPECT_S
            by_name = {}
        again = []
        for i in members:
            r = by_name.get(todo[i].name)
            if r is None or not r.delivered:
                again.append(i)
            elif r.HasField("error"):
                out[i] = status.from_detail(r.error)
            else:
                try:
                    out[i] = reply_type.FromString(r.reply)
                except DecodeError as e:
                    out[i] = errors.Internal(
                        f"{todo[i].name} relayed a malformed {method} reply: {e}",
                        "see the relay agent's log",
                    )
        await asyncio.gather(*(direct(i) for i in again))
        t1 = time.time()
        for i in members:
            if ended is not None:
                ended(todo[i], t0, t1)

    await asyncio.gather(*(group(g) for g in relay.groups(len(todo))))
    return out


def stream_all(
    agents: Sequence[AgentHandle], method: str, request: Any
) -> Iterator[tuple[str, Any]]:
    """The response-streaming `method` on every agent at once, on the process's event loop;
    yields (agent, message) as they arrive, and a failure of one agent as (agent, exception)
    while the others go on. Leaving early cancels the calls. `request`: the same message for
    all, or a function making each agent's (made on the loop's thread: keep it short).

    Messages reach this thread in batches (one wake-up for whatever arrived meanwhile): a
    wake-up per message was a third of the coordinator's time in a 2,048-node upload."""
    arrived: collections.deque[tuple[str, Any]] = collections.deque()
    ready = threading.Event()
    done = object()

    async def pump(a: AgentHandle) -> None:
        try:
            req = request(a) if callable(request) else request
            async for msg in a.aio.stream(method, req):
                arrived.append((a.name, msg))
                ready.set()
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            arrived.append((a.name, e))
        finally:
            arrived.append((a.name, done))
            ready.set()

    async def every() -> None:
        await asyncio.gather(*(pump(a) for a in agents))

    pumps = LOOP.soon(every())  # one hand-over to the loop for all of them
    try:
        open_ = len(agents)
        while open_:
            ready.wait()
            ready.clear()
            while arrived:
                name, msg = arrived.popleft()
                if msg is done:
                    open_ -= 1
                    continue
                yield name, msg
    finally:
        pumps.cancel()


def open_rdzv_req(spec: JobSpec) -> agent_pb2.OpenRdzvRequest:
    """OpenRdzv on node 0's agent: the job's rendezvous server, started with its Python."""
    return agent_pb2.OpenRdzvRequest(job_id=spec.job_id, python=spec.python, env=spec.env,
                                     spare=spec.recovery.mode == "auto")  # fmt: skip
