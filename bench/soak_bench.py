"""Soak: hundreds of short jobs through one node agent (the embedded daemon), then through the
agents of a 2-node deployment (network-namespace nodes), with a freeze-and-continue on every
third job, a --stop + thaw on every fifth, a killed rank and refused freezes among them
(tests/support/soak.py). Each agent's descriptors, threads, children, zombies and RSS are read
from /proc after every job; growth shows as a slope per 100 jobs, fitted after the first
`--warmup` jobs (imports, gRPC pools, allocator arenas settle there).

Usage: python bench/soak_bench.py [--jobs 500] [--multinode-jobs 200] [--json out.json]
Needs root and CRIU (deploy/install.sh).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.cli import SnapCli  # noqa: E402
from tests.support.multinode import Deployment  # noqa: E402
from tests.support.netns import Cluster  # noqa: E402
from tests.support.soak import Soak, SoakReport, describe, leftovers  # noqa: E402

METRICS = ("fds", "threads", "children", "zombies", "rss_bytes")


def _table(report: SoakReport, agent: str, every: int) -> list[str]:
    rows = [f"  {'jobs':>5} {'t (s)':>7} " + " ".join(f"{m:>10}" for m in METRICS)]
    for s in report.samples:
        if s.job % every == 0 or s is report.samples[-1]:
            r = s.by_agent[agent]
            rows.append(
                f"  {s.job:>5} {s.t:>7.0f} "
                + " ".join(f"{getattr(r, m):>10}" for m in METRICS[:-1])
                + f" {r.rss_bytes / 2**20:>8.1f}Mi"
            )
    return rows


def summarize(name: str, report: SoakReport, warmup: int, every: int) -> dict[str, Any]:
    out: dict[str, Any] = {"outcomes": report.outcomes, "agents": {}}
    print(f"\n== {name}: {report.outcomes}")
    for agent in report.samples[0].by_agent:
        slopes = {m: 100 * report.slope(agent, m, skip=warmup) for m in METRICS}
        first = report.samples[min(warmup, len(report.samples)) - 1].by_agent[agent]
        last = report.samples[-1].by_agent[agent]
        print(f"agent {agent}:")
        print("\n".join(_table(report, agent, every)))
        print(
            "  growth per 100 jobs after the first "
            f"{warmup}: "
            + ", ".join(
                f"{m} {v / 2**20:+.2f} MiB" if m == "rss_bytes" else f"{m} {v:+.2f}"
                for m, v in slopes.items()
            )
        )
        out["agents"][agent] = {
            "after_warmup": describe(first),
            "end": describe(last),
            "slope_per_100_jobs": slopes,
            "series": [
                {"job": s.job, "t": s.t, **describe(s.by_agent[agent])} for s in report.samples
            ],
        }
    return out


def single_node(n: int, work: Path) -> tuple[SoakReport, dict[str, list[str]]]:
    cli = SnapCli(work / "home")
    try:
        cli.run("jobs")

        def pid() -> dict[str, int]:
            return {"embedded": int(json.loads((cli.home / "daemon.json").read_text())["pid"])}

        soak = Soak(cli, work, pid)
        t0 = time.monotonic()
        soak.run(n, lambda i, s: _progress("single node", i, n, t0))
        soak.settle()
        return soak.report, leftovers(cli.home)
    finally:
        cli.close()


def multi_node(n: int, work: Path) -> tuple[SoakReport, dict[str, list[str]]]:
    with Cluster(["ctl", "a", "b"]) as cluster:
        dep = Deployment(cluster, work, f"file://{work / 'store'}")
        try:
            dep.start(["a", "b"])
            cli = dep.cli

            def start(out: Path, args: tuple[str, ...]) -> str:
                return cli.start_job(out, *args, nproc=1, nnodes=2, nodes="a,b")

            soak = Soak(
                cli,
                work,
                lambda: {name: p.pid for name, p in dep.agents.items()},
                start=start,
                thaw_args=("--nodes", "b,a"),  # every thaw moves both ranks to the other node
            )
            t0 = time.monotonic()
            soak.run(n, lambda i, s: _progress("two nodes", i, n, t0))
            soak.settle()
            left = {k: v for a in ("a", "b") for k, v in leftovers(dep.home(a)).items() if v}
            return soak.report, left
        finally:
            dep.close()


def _progress(what: str, i: int, n: int, t0: float) -> None:
    if i % 25 == 0 or i == n:
        print(f"[{what}] {i}/{n} jobs, {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--multinode-jobs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    result: dict[str, Any] = {}
    # Kept when something fails (its logs are the evidence), removed after a clean run.
    tmp = tempfile.mkdtemp(prefix="soak-")
    print(f"work directory: {tmp}", file=sys.stderr)
    try:
        every = max(1, a.jobs // 10)
        if a.jobs:
            rep, left = single_node(a.jobs, Path(tmp) / "single")
            result["single_node"] = summarize("single node (embedded daemon)", rep, a.warmup, every)
            result["single_node"]["leftovers"] = left
            print(f"  leftovers under SNAPSHOTTER_HOME: {left}")
        if a.multinode_jobs:
            rep, left = multi_node(a.multinode_jobs, Path(tmp) / "multi")
            every = max(1, a.multinode_jobs // 10)
            result["two_nodes"] = summarize("two netns nodes", rep, a.warmup, every)
            result["two_nodes"]["leftovers"] = left
            print(f"  leftovers under the agents' homes: {left}")
    except BaseException:
        print(f"soak failed; its logs are under {tmp}", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
