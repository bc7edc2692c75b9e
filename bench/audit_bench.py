"""Cluster audit time for 2, 4 and 8 nodes (issue 17): network-namespace nodes with one data
link each, agents and a coordinator as processes with mutual TLS, a local-directory store.
Each size: `snapshotter audit --json` --runs times; the median wall time, the audit's own
time and rounds. Rounds grow as N (N-1 for even N), probes as N²/2; with every "node" on
this host's cores the probes of a round compete for the same CPU, so time per round grows
too here, which separate machines would not show.

    .venv/bin/python bench/audit_bench.py [--sizes 2,4,8] [--runs 3] [--link-mib 8]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.multinode import Deployment  # noqa: E402
from tests.support.netns import Cluster  # noqa: E402


def one_size(n: int, runs: int, link_mib: float, work: Path) -> dict[str, float]:
    nodes = [chr(ord("a") + i) for i in range(n)]
    with Cluster(["ctl", *nodes], data_links=1) as cluster:
        dep = Deployment(cluster, work / f"dep{n}", f"file://{work / f'store{n}'}")
        try:
            dep.start(nodes)
            walls, own, rounds, probes = [], [], 0, 0
            for _ in range(runs):
                t = time.monotonic()
                p = dep.cli.run("audit", "--json", "--link-mib", str(link_mib),
                                "--storage-mib", "1", check=False, timeout=1800)  # fmt: skip
                walls.append(time.monotonic() - t)
                if p.returncode not in (0, 18):
                    raise RuntimeError(p.stderr[-2000:])
                rep = json.loads(p.stdout.strip().splitlines()[-1])
                own.append(rep["seconds"])
                rounds, probes = rep["rounds"], len(rep["links"])
        finally:
            dep.close()
    return {"nodes": n, "wall_s": statistics.median(walls), "audit_s": statistics.median(own),
            "rounds": rounds, "probes": probes}  # fmt: skip


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--link-mib", type=float, default=8.0)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="snapshotter-audit-bench-") as tmp:
        for n in (int(x) for x in a.sizes.split(",")):
            rows.append(one_size(n, a.runs, a.link_mib, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    print("\nnodes  rounds  probes  audit s (median)  wall s  s/round")
    for r in rows:
        print(f"{r['nodes']:5d}  {r['rounds']:6d}  {r['probes']:6d}  {r['audit_s']:16.2f}  "
              f"{r['wall_s']:6.2f}  {r['audit_s'] / max(1, r['rounds']):7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
