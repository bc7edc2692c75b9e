"""Weight push from and into CUDA tensors (issue 16), for a lent GPU machine: a publisher
job whose state lives on GPU 0 and a replica job on another node agent (both agents in this
process, gRPC over unix sockets, tests/support/agents.py) whose tensors are on GPU 0 too.
Every rep the replica checks every element it received; prints one JSON line with the
medians. `--device cpu` rehearses it here.

    python bench/gpu_weights_check.py --device cuda --mib 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.weights_bench import latencies  # noqa: E402
from tests.support.agents import Cluster  # noqa: E402

JOB = ROOT / "bench" / "weights_job.py"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--reps", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpu-weights-") as tmp:
        work = Path(tmp)
        d = work / "stamps"
        d.mkdir()
        common = ("--how", "push", "--dir", str(d), "--mib", str(a.mib), "--reps", str(a.reps),
                  "--device", a.device)  # fmt: skip
        c = Cluster(work / "cluster", ("pub", "rep"), JOB)
        try:
            rep = c.run("replica", "rep", "--role", "replica", "--name", "rep", *common)
            pub = c.run("publisher", "pub", "--role", "publisher", "--replicas", "1", *common)
            c.wait(pub, 600)
            c.wait(rep, 120)
            lat, stall = latencies(d, work / "cluster" / "publisher.json", 1)
        finally:
            c.close()
    print(json.dumps({"case": "weights", "device": a.device, "mib": a.mib,
                      "latency_s": statistics.median(lat), "stall_s": statistics.median(stall),
                      "GBps": a.mib / 1024 / statistics.median(lat), "ok": True}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
