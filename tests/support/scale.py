"""The coordinator at scale: a real Coordinator and its gRPC service in this process, driving
simulated agents (simagents.py) in others; one freeze's phases timed, heartbeats' CPU and the
coordinator's memory measured. Shared by tests/functional/test_scale.py and
bench/scale_bench.py.

What is timed is the coordinator's side of a freeze: from the moment it yields a phase's event
to the next, every agent answering at once (the simulated data phases take no time, so dump
and upload measure only their fan-out). This process is the coordinator's: its CPU time and
RSS are the coordinator's (the agents live in their own processes).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshotter.coordinator import service as coordinator_service
from snapshotter.coordinator.core import Coordinator
from snapshotter.rpc.aio import LOOP
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import Listen, Served, serve
from snapshotter.storage import LocalDirStore
from snapshotter.v1 import coordinator_pb2 as pb
from tests.support.simagents import PHASES, SimHosts

# The phases reported, in order; "control" sums the ones the job's ranks wait on that are not
# data (the "control-plane time": prepare, park, suspend, resume, commit, finish).
COLUMNS = ("status", "prepare", "park", "suspend", "dump", "resume", "upload", "commit",
           "finish")  # fmt: skip
CONTROL = ("prepare", "park", "suspend", "resume", "commit", "finish")


def rss_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class FreezeTiming:
    snapshot_id: str
    phases: dict[str, float]  # seconds per column
    cpu_s: float  # the coordinator's CPU time for the whole freeze
    # Its event loop's share (rpc/aio.py): every fan-out's calls, streams and replies.
    loop_cpu_s: float = 0.0
    # The loop's CPU from prepare to the end, less the upload: the control phases' fan-outs
    # (and the dump's, which runs between the same events as resume).
    loop_ctl_s: float = 0.0

    @property
    def control_s(self) -> float:
        return sum(self.phases[p] for p in CONTROL)


@dataclass
class ThawTiming:
    fetch_s: float  # the fetch phase: every node's Fetch stream, to its last `fetched`
    restore_s: float  # every node's Restore, to the thaw's end
    total_s: float
    cpu_s: float  # the coordinator's CPU time for the whole thaw
    # The most threads this process ran during the thaw, above those it ran before: the
    # fan-outs ride the event loop, not a thread per node.
    extra_threads: int


def _span_range(spans: list[Any], phase: str) -> float:
    mine = [s for s in spans if s.phase == phase]
    return max(s.end for s in mine) - min(s.start for s in mine) if mine else 0.0


class ScaleRig:
    """A coordinator serving on a unix socket under `tmp`, and `agents` x `nproc` simulated
    ranks registered with it."""

    def __init__(self, tmp: Path, agents: int, nproc: int = 8, procs: int | None = None,
                 heartbeat_s: float = 2.0, max_beats_per_s: float = 512.0) -> None:  # fmt: skip
        self.agents, self.nproc = agents, nproc
        store = LocalDirStore(tmp / "store")
        self.store = store
        # Long ttl: a host process busy starting others' servers must not lose its agents.
        self.coord = Coordinator(store, f"file://{tmp / 'store'}",
                                 lambda address, name: Target(address, server_name=name),
                                 agent_ttl=max(15.0, 6 * heartbeat_s),
                                 max_beats_per_s=max_beats_per_s)  # fmt: skip
        run = tmp / "run"
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
        (tmp / "socks").mkdir(exist_ok=True)
        self.server: Served = serve("coordinator", Listen(f"unix:{run / 'coordinator.sock'}"),
                                    coordinator_service.register(self.coord),
                                    [coordinator_service.SERVICE])  # fmt: skip
        t0 = time.monotonic()
        self.rss_before_mib = rss_mib()
        self.hosts = SimHosts(agents, nproc, procs or max(1, min(4, agents // 256)),
                              str(tmp / "socks"), self.server.address, heartbeat_s)  # fmt: skip
        self.start_s = time.monotonic() - t0
        self.job_id = ""

    def close(self) -> None:
        self.hosts.close()
        self.server.stop(0)

    def __enter__(self) -> ScaleRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(self) -> float:
        """Run one job over every agent; seconds the coordinator took."""
        t0 = time.monotonic()
        st = self.coord.run(pb.RunRequest(
            job_id="scale", script="train.py", python=sys.executable, cwd="/",
            nnodes=self.agents, nproc_per_node=self.nproc, nodes=self.hosts.names))  # fmt: skip
        assert st.state == "RUNNING", st.state
        self.job_id = st.job_id
        return time.monotonic() - t0

    def freeze(self, job_id: str | None = None) -> FreezeTiming:
        """One freeze-and-continue of the job (or `job_id`), timed by phase from its events
        and spans."""
        marks: list[tuple[str, float]] = []
        loop_at: dict[str, float] = {}
        t0, c0, l0 = time.monotonic(), time.process_time(), LOOP.cpu_s()
        done: pb.FreezeDone | None = None
        events: Iterator[pb.FreezeEvent] = self.coord.freeze(
            pb.FreezeRequest(job_id=job_id or self.job_id)
        )
        for ev in events:
            now = time.monotonic()
            if ev.HasField("phase"):
                marks.append((ev.phase.phase, now))
                loop_at[ev.phase.phase] = LOOP.cpu_s()
            elif ev.HasField("done"):
                done = ev.done
                marks.append(("done", now))
                loop_at["done"] = LOOP.cpu_s()
        cpu, loop_cpu = time.process_time() - c0, LOOP.cpu_s() - l0
        assert done is not None, marks
        at = dict(marks)
        spans = list(done.stats.spans)
        phases = {
            "status": at["prepare"] - t0,  # the job's state asked of every node, first
            "prepare": at["quiesce"] - at["prepare"],
            "park": at["suspend"] - at["quiesce"],
            "suspend": at["dump"] - at["suspend"],
            # dump and resume run between the same two events: the spans tell them apart.
            "dump": (at["resumed"] - at["dump"]) - _span_range(spans, "resume"),
            "resume": _span_range(spans, "resume"),
            "upload": at["commit"] - at["upload"],
            # The manifest built, checked and written, then every node told (finish).
            "commit": at["done"] - at["commit"] - _span_range(spans, "finish"),
            "finish": _span_range(spans, "finish"),
        }
        loop_ctl = (loop_at["done"] - loop_at["prepare"]) - (loop_at["commit"] - loop_at["upload"])
        return FreezeTiming(done.snapshot_id, phases, cpu, loop_cpu, loop_ctl)

    def thaw(self, snapshot_id: str, job_id: str) -> ThawTiming:
        """Thaw `snapshot_id` as `job_id` onto the same nodes in the same order (each node gets
        the stream it uploaded), timed by phase from its events."""
        base = threading.active_count()
        peak = [base]
        done_ev = threading.Event()

        def sample() -> None:
            while not done_ev.wait(0.005):
                peak[0] = max(peak[0], threading.active_count())

        sampler = threading.Thread(target=sample, daemon=True, name="thread-sampler")
        sampler.start()
        marks: dict[str, float] = {}
        t0, c0 = time.monotonic(), time.process_time()
        try:
            for ev in self.coord.thaw(pb.ThawRequest(snapshot_id=snapshot_id, job_id=job_id,
                                                     nodes=self.hosts.names)):  # fmt: skip
                if ev.HasField("phase") and not ev.phase.node:
                    marks.setdefault(ev.phase.phase, time.monotonic())
                elif ev.HasField("done"):
                    marks["done"] = time.monotonic()
        finally:
            done_ev.set()
            sampler.join()
        cpu = time.process_time() - c0
        assert {"fetch", "restore", "done"} <= set(marks), marks
        fetch_s, restore_s = marks["restore"] - marks["fetch"], marks["done"] - marks["restore"]
        return ThawTiming(fetch_s, restore_s, marks["done"] - t0, cpu, peak[0] - base - 1)

    def heartbeat_cpu(self, window_s: float = 10.0) -> tuple[float, int]:
        """The coordinator's CPU seconds per second while only heartbeats arrive, and how many
        arrived meanwhile."""
        before = sum(r["beats"] for r in self.hosts.report().values())
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(window_s)
        cpu, wall = time.process_time() - c0, time.monotonic() - t0
        after = sum(r["beats"] for r in self.hosts.report().values())
        return cpu / wall, after - before

    def check(self, freezes: int) -> dict[str, dict[str, Any]]:
        """Raises AssertionError unless every simulated rank went through every phase in order,
        `freezes` times, nothing was refused, and every agent is alive to the coordinator."""
        report = self.hosts.report()
        want = list(PHASES) * freezes
        bad = {n: r for n, r in report.items()
               if r["refused"] or len(r["ranks"]) != self.nproc
               or any(seen != want for seen in r["ranks"].values())}  # fmt: skip
        assert not bad, (
            f"{len(bad)} agent(s) saw phases out of order, e.g. {next(iter(bad.items()))}"
        )
        live = self.coord.live_agents()
        lost = sorted(set(self.hosts.names) - set(live))
        assert not lost, f"agents the coordinator counts as lost: {lost[:10]}"
        return report


def table(rows: dict[int, list[FreezeTiming]], extra: dict[int, dict[str, str]],
          nproc: int = 8) -> str:  # fmt: skip
    """Median seconds per phase, by number of agents; growth against the first row."""
    import statistics

    cols = [*COLUMNS, "control"]
    head = f"{'agents':>6} {'ranks':>6} " + " ".join(f"{c:>8}" for c in cols)
    keys = list(next(iter(extra.values()))) if extra else []
    head += "".join(f" {k:>10}" for k in keys)
    lines = [head]
    base: dict[str, float] = {}
    for n, runs in rows.items():
        med = {c: statistics.median(r.phases[c] for r in runs) for c in COLUMNS}
        med["control"] = statistics.median(r.control_s for r in runs)
        base = base or med
        ranks = n * nproc
        lines.append(f"{n:>6} {ranks:>6} " + " ".join(f"{med[c]:8.3f}" for c in cols)
                     + "".join(f" {extra[n][k]:>10}" for k in keys))  # fmt: skip
        if med is not base:
            lines.append(
                f"{'':>6} {'growth':>6} "
                + " ".join(
                    f"{med[c] / base[c]:7.1f}x" if base[c] > 0 else f"{'-':>8}" for c in cols
                )
            )
    return "\n".join(lines)
