"""A freeze renews every node's lease from one ticking thread (not a thread per node), and a
node that does not answer never holds up the others' renewals."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from snapshotter import errors
from snapshotter.coordinator.freeze import FreezeOperation, FreezeSettings
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc.client import Target


class _Calls:
    """An agent handle's calls on the event loop (rpc/aio.py), counting the renewals."""

    def __init__(self, hang: threading.Event | None) -> None:
        self.renewals = 0
        self.hang = hang
        self.threads: set[str] = set()

    async def call(self, method: str, request: Any, timeout: float | None) -> Any:
        assert method == "KeepFreeze", method
        self.renewals += 1
        self.threads.add(threading.current_thread().name)
        if self.hang is not None:
            while not self.hang.is_set():  # a call stuck in the transport, never answered
                await asyncio.sleep(0.05)
            raise errors.ServiceUnavailable("no answer", "wait")
        return None


class _Agent:
    def __init__(self, name: str, hang: threading.Event | None = None) -> None:
        self.name = name
        self.incarnation = ""
        self.aio = _Calls(hang)
        self.target = Target("unix:/nowhere")


def test_every_node_is_renewed_and_a_silent_one_delays_no_other() -> None:
    released = threading.Event()
    agents = [_Agent(f"n{i}") for i in range(200)] + [_Agent("silent", hang=released)]
    spec = JobSpec("j", "t.py", [], False, "python", "/", {})
    op = FreezeOperation(spec, agents, store=None, stop=False,  # type: ignore[arg-type]
                         settings=FreezeSettings(keepalive_s=0.1), on_committed=print)  # fmt: skip
    before = threading.active_count()
    done = threading.Event()
    op._keep_alive(done)
    # Waits for the outcome, not a fixed time: on a loaded CI machine 0.65 s once held
    # only 3 ticks. The silent node's one call stays in flight the whole time.
    deadline = time.monotonic() + 30.0
    try:
        while min(a.aio.renewals for a in agents[:-1]) < 4 and time.monotonic() < deadline:
            assert threading.active_count() - before < 150  # not a thread per node
            time.sleep(0.05)
        renewed = [a.aio.renewals for a in agents[:-1]]
        silent = agents[-1].aio.renewals
    finally:
        done.set()
        released.set()
    assert min(renewed) >= 4, renewed  # renewed again and again, whatever the silent node does
    assert silent == 1  # still in flight: never asked twice at once
    # Every renewal ran on the one event-loop thread, none on a thread of its own.
    assert len(set().union(*(a.aio.threads for a in agents))) == 1


def test_a_node_with_a_phase_call_in_flight_or_just_made_is_not_renewed() -> None:
    agents = [_Agent("busy"), _Agent("recent"), _Agent("idle")]
    spec = JobSpec("j", "t.py", [], False, "python", "/", {})
    op = FreezeOperation(spec, agents, store=None, stop=False,  # type: ignore[arg-type]
                         settings=FreezeSettings(keepalive_s=1.0), on_committed=print)  # fmt: skip
    # A phase call that stays in flight on "busy" (as a Dump does) holds its lease: `_call`
    # counts each call in at its start and out at its end.
    op._calling("busy", +1)
    done = threading.Event()
    op._keep_alive(done)
    # Until "idle" has been renewed 3 times (30 s at most: a loaded machine ticks late);
    # "recent" stays 0.45 s short of needing one (renewed at 0.5 s idle) however late a tick.
    t_end = time.monotonic() + 30.0
    try:
        while agents[2].aio.renewals < 3 and time.monotonic() < t_end:
            # "recent" answers a phase call every 0.05 s
            op._calling("recent", +1)
            op._calling("recent", -1)
            time.sleep(0.05)
    finally:
        done.set()
        op._calling("busy", -1)
    assert agents[0].aio.renewals == 0 and agents[1].aio.renewals == 0
    assert agents[2].aio.renewals >= 3


def test_a_lease_is_renewed_within_three_quarters_of_keepalive_after_the_last_call() -> None:
    """The agent's lease counts from a call's start and its end; the ticker renews a node
    idle for half of keepalive_s, ticking every quarter: within 0.75 x keepalive_s of the
    last call (3.75 s with the default 5 s; an 8 s lease once ran out with ~10 s)."""
    spec = JobSpec("j", "t.py", [], False, "python", "/", {})
    op = FreezeOperation(spec, [_Agent("a")], store=None, stop=False,  # type: ignore[arg-type]
                         settings=FreezeSettings(keepalive_s=4.0), on_committed=print)  # fmt: skip
    op._calling("a", +1)
    assert not op._needs_renewal("a", time.monotonic() + 100)  # in flight: held by the call
    op._calling("a", -1)  # a long call (a Dump) ends: counted from its end, not its start
    ended = time.monotonic()
    assert not op._needs_renewal("a", ended + 1.9)
    assert op._needs_renewal("a", ended + 2.1)
