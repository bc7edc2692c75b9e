"""The node agents as the coordinator sees them: a typed client per agent, and a helper that
runs one call on many agents at once (every phase of a freeze or thaw is parallel across nodes).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from snapshotter.launch.spec import JobSpec
from snapshotter.rpc.wire import Client

AGENT_SERVICE = "snapshotter.Agent"
Msg = dict[str, Any]
T = TypeVar("T")


@dataclass
class AgentHandle:
    name: str
    address: str
    host: str
    # The coordinator's fencing token, sent with every call (snapshotter/agent/fencing.py).
    fence: tuple[int, str] | None = None
    # time.monotonic() of the agent's last registration heartbeat (None: never expires).
    seen: float | None = None
    # Changes when the agent process restarts (its jobs are then gone or orphaned).
    incarnation: str = ""

    def __post_init__(self) -> None:
        self.client = Client(self.address, AGENT_SERVICE)

    def _with_fence(self, req: Msg | None) -> Msg:
        out = dict(req or {})
        if self.fence is not None:
            out["fence"] = list(self.fence)
        return out

    def call(self, method: str, req: Msg | None = None, timeout: float | None = 60.0) -> Msg:
        return self.client.call(method, self._with_fence(req), timeout=timeout)

    def stream(self, method: str, req: Msg | None = None) -> Iterator[Msg]:
        return self.client.stream(method, self._with_fence(req))

    def close(self) -> None:
        """Close the channel (the agent was replaced or forgotten; calls on it fail)."""
        self.client.close()


def open_store_req(spec: JobSpec) -> Msg:
    """OpenStore on node 0's agent: the job's rendezvous store, started with its Python."""
    return {"job_id": spec.job_id, "python": spec.python, "env": spec.env}


def on_all(
    agents: Sequence[AgentHandle], fn: Callable[[AgentHandle], T]
) -> tuple[dict[str, T], dict[str, BaseException]]:
    """Run fn on every agent in parallel; results and failures by agent name."""
    results: dict[str, T] = {}
    failures: dict[str, BaseException] = {}
    if not agents:
        return results, failures
    with ThreadPoolExecutor(max_workers=len(agents)) as pool:
        futs = {a.name: pool.submit(fn, a) for a in agents}
        for name, f in futs.items():
            try:
                results[name] = f.result()
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                failures[name] = e
    return results, failures


def merge_streams(
    agents: Sequence[AgentHandle], method: str, req_for: Callable[[AgentHandle], Msg]
) -> Iterator[tuple[str, Msg | BaseException]]:
    """Run a streaming call on every agent at once, yielding (agent, event) as they arrive.
    A failure of one agent arrives as (agent, exception); the others continue."""
    q: queue.Queue[tuple[str, Msg | BaseException | None]] = queue.Queue()

    def pump(a: AgentHandle) -> None:
        try:
            for ev in a.stream(method, req_for(a)):
                q.put((a.name, ev))
        except BaseException as e:  # noqa: BLE001
            q.put((a.name, e))
        finally:
            q.put((a.name, None))

    for a in agents:
        threading.Thread(target=pump, args=(a,), daemon=True, name=f"{method}-{a.name}").start()
    open_ = len(agents)
    while open_:
        name, ev = q.get()
        if ev is None:
            open_ -= 1
            continue
        yield name, ev
