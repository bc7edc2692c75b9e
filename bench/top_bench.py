"""How soon `snapshotter top` names a straggler and a slow link, and whether it names anything
in a healthy job (issue 17 part 3). Network-namespace nodes with one data link each, agents and
a coordinator as processes with mutual TLS, a local-directory store; examples/train_ddp.py.

Each run: a 2x2 job (nodes a, b; batches of 512, 20 ms pause a step) sampled --healthy times
(any rank or link named counts as a false finding), then rank 3 limited to --cpu of a CPU by
its cgroup: samples and steps until it is named; then a 3x1 job (a, b, c) with node b's link
rate-limited (tbf 20mbit; this kernel has no netem): samples and steps until node b's link is
named. A sample is one `snapshotter top --json` (about 1 s here with the CLI's start).

    .venv/bin/python bench/top_bench.py [--runs 3] [--cpu 0.03] [--healthy 10]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.cpulimit import cpu_limit  # noqa: E402
from tests.support.multinode import Deployment, qdisc, rank_pid  # noqa: E402
from tests.support.netns import Cluster  # noqa: E402

JOB = ("--steps", "1000000", "--step-sleep", "0.02", "--batch", "512", "--workers", "0")


def top(dep: Deployment, job: str) -> dict[str, Any]:
    rep: dict[str, Any] = dep.cli.json("top", job, timeout=120)
    return rep


def steps(rep: dict[str, Any]) -> int:
    return min((r.get("steps", 0) for r in rep.get("ranks", [])), default=0)


def until(dep: Deployment, job: str, cond: Callable[[dict[str, Any]], bool],
          timeout: float = 300) -> tuple[int, int]:  # fmt: skip
    """Samples and steps until `cond` (from the first sample's steps)."""
    first, n, deadline = None, 0, time.monotonic() + timeout
    while True:
        rep = top(dep, job)
        n += 1
        first = steps(rep) if first is None else first
        if cond(rep):
            return n, steps(rep) - first
        if time.monotonic() > deadline:
            raise TimeoutError(f"not seen in {timeout:.0f}s: {rep}")
        time.sleep(1)


def stepping(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda r: len(r.get("ranks", [])) == n and all(
        x.get("steps", 0) > 20 for x in r["ranks"])  # fmt: skip


def one_run(dep: Deployment, work: Path, i: int, cpu: float, healthy: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    job = dep.cli.start_job(work / f"s{i}.json", *JOB, nodes="a,b")
    try:
        until(dep, job, stepping(4))
        false = 0
        for _ in range(healthy):
            rep = top(dep, job)
            false += bool(rep.get("slowest_rank", -1) >= 0 or rep.get("slowest_link"))
            time.sleep(1)
        out["healthy_samples"], out["false_findings"] = healthy, false
        with cpu_limit(rank_pid(dep, "b", job, 3), cpu):
            out["straggler_samples"], out["straggler_steps"] = until(
                dep, job, lambda r: r.get("slowest_rank", -1) == 3)
    finally:
        dep.cli.run("cancel", job, check=False)
    job = dep.cli.start_job(work / f"l{i}.json", *JOB, nodes="a,b,c", nnodes=3, nproc=1)
    try:
        until(dep, job, stepping(3))
        qdisc(dep.cluster["b"], 0, "tbf rate 20mbit burst 32kbit latency 50ms")
        try:
            out["link_samples"], out["link_steps"] = until(
                dep, job, lambda r: r.get("slowest_link") == "b (every link)")
        finally:
            qdisc(dep.cluster["b"], 0, None)
    finally:
        dep.cli.run("cancel", job, check=False)
    return out


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpu", type=float, default=0.03, help="the straggler's share of a CPU")
    ap.add_argument("--healthy", type=int, default=10, help="samples of the healthy job a run")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="snapshotter-top-bench-") as tmp:
        work = Path(tmp)
        with Cluster(["ctl", "a", "b", "c"], data_links=1) as cluster:
            dep = Deployment(cluster, work / "dep", f"file://{work / 'store'}")
            try:
                dep.start(["a", "b", "c"])
                for i in range(a.runs):
                    rows.append(one_run(dep, work, i, a.cpu, a.healthy))
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                dep.close()
    def med(k: str) -> float:
        return statistics.median(r[k] for r in rows)

    print(f"\nruns {len(rows)}: false findings {sum(r['false_findings'] for r in rows)} in "
          f"{sum(r['healthy_samples'] for r in rows)} healthy samples; straggler ({a.cpu:.0%} "
          f"of a CPU) named after {med('straggler_samples'):.0f} sample(s), "
          f"{med('straggler_steps'):.0f} step(s) (medians); slow link after "
          f"{med('link_samples'):.0f} sample(s), {med('link_steps'):.0f} step(s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
