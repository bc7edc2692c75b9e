"""One call on every agent at once, three ways, side by side in one run: a blocking stub per
agent on threads (`on_all`, how every fan-out went before), the coordinator's event loop
(`call_all`, rpc/aio.py) with a gRPC call per agent ("aio"), and the same carried by each
agent's Control stream (rpc/control.py, what `call_all` does now: "control"). Real simulated
agents (tests/support/simagents.py: gRPC servers on unix sockets, heartbeating a real
coordinator), the same agents for all three, runs interleaved.

Prints per number of agents the median wall and CPU seconds of this process per fan-out, and
the ratios aio / threads and control / aio.

    .venv/bin/python bench/fanout_bench.py [--agents 512,2048] [--runs 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshotter.coordinator.agents import AgentHandle, call_all, on_all  # noqa: E402
from snapshotter.v1 import common_pb2  # noqa: E402
from tests.support.scale import ScaleRig  # noqa: E402


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    t0, c0 = time.monotonic(), time.process_time()
    fn()
    return time.monotonic() - t0, time.process_time() - c0


def one_size(n: int, runs: int) -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory(prefix="fanout-") as d, ScaleRig(Path(d), n) as rig:
        agents: list[AgentHandle] = list(rig.coord.live_agents().values())
        ping = common_pb2.Empty()

        # The same agents through handles whose calls are calls of their own (rpc/aio.py reads
        # the switch as a handle is made).
        os.environ["SNAPSHOTTER_CONTROL_STREAM"] = "0"
        unary = [dataclasses.replace(a) for a in agents]
        del os.environ["SNAPSHOTTER_CONTROL_STREAM"]

        def threads() -> None:
            on_all(agents, lambda a: a.stub.Ping(ping, timeout=60)).raise_first()

        def aio() -> None:
            call_all(unary, "Ping", ping, 60).raise_first()

        def control() -> None:
            call_all(agents, "Ping", ping, 60).raise_first()

        arms = {"threads": threads, "aio": aio, "control": control}
        for fn in arms.values():  # connections opened, pools warm
            fn()
        got: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
        for _ in range(runs):
            for k, fn in arms.items():
                got[k].append(_timed(fn))
        return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
                for k, v in got.items()}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="512,2048")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    print(f"{'agents':>6} {'arm':>8} {'wall_s':>8} {'cpu_s':>8}   (median of {a.runs})")
    for n in (int(x) for x in a.agents.split(",")):
        r = one_size(n, a.runs)
        for arm, (wall, cpu) in r.items():
            print(f"{n:>6} {arm:>8} {wall:8.3f} {cpu:8.3f}")
        (tw, tc), (aw, ac), (cw, cc) = r["threads"], r["aio"], r["control"]
        print(f"{n:>6} {'aio/thr':>8} {aw / tw:7.2f}x {ac / tc:7.2f}x")
        print(f"{n:>6} {'ctl/aio':>8} {cw / aw:7.2f}x {cc / ac:7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
