"""The node agents as the coordinator sees them: a typed client per agent, one call on many
agents at once (every phase of a freeze or thaw is parallel across nodes), and many streams
merged into one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from snapshotter import parallel
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc.client import Client, Target, agent_client
from snapshotter.v1 import agent_pb2, common_pb2

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
    # Changes when the agent process restarts (its jobs are then gone or orphaned).
    incarnation: str = ""
    version: str = ""
    # Its data links in plane order, as its last heartbeat reported them (agent/links.py).
    links: list[common_pb2.LinkState] = field(default_factory=list)
    client: Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = agent_client(self.target)

    @property
    def stub(self) -> Any:
        """The generated AgentStub: every call carries our version, credentials and fence."""
        return self.client.stub

    def close(self) -> None:
        """Close the channel (the agent was replaced or forgotten; calls on it fail)."""
        self.client.close()

    def retire(self, after_s: float = RETIRE_S) -> None:
        """Close the channel later: an operation may still be calling the old incarnation
        from another thread, and grpc closing a channel under a call in flight can crash
        the process (seen here: a segfault in cygrpc when an agent restarted mid-upload)."""
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


def open_rdzv_req(spec: JobSpec) -> agent_pb2.OpenRdzvRequest:
    """OpenRdzv on node 0's agent: the job's rendezvous server, started with its Python."""
    return agent_pb2.OpenRdzvRequest(job_id=spec.job_id, python=spec.python, env=spec.env,
                                     spare=spec.recovery.mode == "auto")  # fmt: skip


def merge_streams(
    agents: Sequence[AgentHandle], call: Callable[[AgentHandle], Iterator[Any]]
) -> Iterator[tuple[str, Any]]:
    """A streaming call on every agent at once, yielding (agent, event) as they arrive. A
    failure of one agent arrives as (agent, exception); the others continue."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue()
    done = object()

    def pump(a: AgentHandle) -> None:
        try:
            for ev in call(a):
                q.put((a.name, ev))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put((a.name, e))
        finally:
            q.put((a.name, done))

    for a in agents:
        # Threads of the shared cached pool: a stream per agent stays open until its node's
        # upload ends, but the threads are not started anew for each of 2,048 agents.
        parallel.CACHED.submit(pump, a)
    open_ = len(agents)
    while open_:
        name, ev = q.get()
        if ev is done:
            open_ -= 1
            continue
        yield name, ev
