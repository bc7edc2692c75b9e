"""Weight push: publish-to-every-replica-updated latency, side by side with what a user would
write without snapshotter, for 2 and 4 replicas, in one run.

    .venv/bin/python bench/weights_bench.py [--mib 128] [--reps 6] [--replicas 2,4]

  push       snapshotter.weights: a publisher job and replica jobs, each on a node of its own
             (network namespaces on this host, tests/support/netns.py: agent processes,
             a coordinator, mutual TLS); bytes go agent to agent over the veth bridge
  saveload   the publisher torch.save()s to a shared directory (local disk here), every
             replica torch.load()s it and copies into its tensors
  broadcast  torch.distributed.broadcast over gloo, publisher = rank 0 (torchrun)

Latency of one rep: from the publisher's start (t0) to the last replica holding the new
weights in its own tensors; the median over reps 2.. (rep 1 warms up) of every method.
GB/s: the state's bytes over that latency (what each replica received per second).
`stall`: how long the publisher's own call took (publish / torch.save / its broadcast).
All on this one host: every "node" shares its cores and memory bandwidth, so this measures
the data path's overheads, not a network; see the README for what a lent GPU machine adds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
JOB = ROOT / "bench" / "weights_job.py"
Lat = tuple[list[float], list[float]]  # latencies, publisher stalls (s)


def latencies(d: Path, out: Path, replicas: int) -> Lat:
    res = json.loads(out.read_text())
    lat = []
    for rep, t0 in enumerate(res["t0"], start=1):
        stamps = [float(p.read_text()) for p in d.glob(f"got-{rep}-*")]
        assert len(stamps) == replicas, (rep, len(stamps))
        lat.append(max(stamps) - t0)
    return lat[1:], res["stall"][1:]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def push(work: Path, replicas: int, args: argparse.Namespace) -> Lat:
    from tests.support.multinode import Deployment
    from tests.support.netns import Cluster

    d = work / "push"
    d.mkdir()
    nodes = ["pub", *(f"r{i}" for i in range(1, replicas + 1))]
    common = ("--how", "push", "--dir", str(d), "--mib", str(args.mib), "--reps", str(args.reps))
    with Cluster(["ctl", *nodes]) as cluster:
        dep = Deployment(cluster, work / "dep", f"file://{work / 'store'}")
        try:
            dep.start(nodes)
            one = {"nnodes": 1, "nproc": 1, "script": JOB}
            jobs = [dep.cli.start_job(work / f"{n}.json", "--role", "replica", "--name", n,
                                      *common, nodes=n, **one) for n in nodes[1:]]  # fmt: skip
            pub = dep.cli.start_job(work / "publisher.json", "--role", "publisher", "--replicas",
                                    str(replicas), *common, nodes="pub", **one)  # fmt: skip
            for j in [pub, *jobs]:
                st = dep.cli.wait(j, timeout=900)
                assert st["state"] == "SUCCEEDED", (st, dep.logs())
        finally:
            dep.close()
    return latencies(d, work / "publisher.json", replicas)


def saveload(work: Path, replicas: int, args: argparse.Namespace) -> Lat:
    d = work / "saveload"
    d.mkdir()
    common = ["--how", "saveload", "--dir", str(d), "--mib", str(args.mib), "--reps",
              str(args.reps)]  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(JOB), "--role", "replica", "--name", f"r{i}",
                               *common], env=_env()) for i in range(replicas)]  # fmt: skip
    out = work / "saveload.json"
    try:
        subprocess.run([sys.executable, str(JOB), "--role", "publisher", "--replicas",
                        str(replicas), "--out", str(out), *common], env=_env(), check=True,
                       timeout=900)  # fmt: skip
        for p in procs:
            assert p.wait(300) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return latencies(d, out, replicas)


def broadcast(work: Path, replicas: int, args: argparse.Namespace) -> Lat:
    d = work / "broadcast"
    d.mkdir()
    out = work / "broadcast.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(replicas + 1), str(JOB), "--role", "broadcast",
                    "--dir", str(d), "--mib", str(args.mib), "--reps", str(args.reps), "--out",
                    str(out)], env=_env(), check=True, timeout=900,
                   capture_output=True)  # fmt: skip
    return latencies(d, out, replicas)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--replicas", default="2,4")
    args = p.parse_args()
    methods = {"push": push, "saveload": saveload, "broadcast": broadcast}
    print(f"state {args.mib} MiB in 8 tensors, {args.reps} reps (medians of reps 2..), "
          f"{os.cpu_count()} cores, one host", flush=True)  # fmt: skip
    rows = []
    for n in (int(x) for x in args.replicas.split(",")):
        res = {}
        for name, fn in methods.items():
            with tempfile.TemporaryDirectory(prefix=f"wbench-{name}-") as tmp:
                started = time.monotonic()
                lat, stall = fn(Path(tmp), n, args)
            res[name] = (statistics.median(lat), statistics.median(stall))
            print(f"  {n} replicas {name:9s} latency {res[name][0] * 1e3:8.1f} ms  "
                  f"{args.mib / 1024 / res[name][0]:6.2f} GB/s/replica  "
                  f"publisher stall {res[name][1] * 1e3:8.1f} ms  "
                  f"({time.monotonic() - started:.0f} s)", flush=True)  # fmt: skip
        rows.append((n, res))
    print("\nreplicas  push ms  saveload ms (÷push)  broadcast ms (÷push)  push stall ms  "
          "torch.save stall ms")  # fmt: skip
    for n, r in rows:
        pl, sl, bl = r["push"][0], r["saveload"][0], r["broadcast"][0]
        print(f"{n:8d}  {pl * 1e3:7.1f}  {sl * 1e3:11.1f} ({sl / pl:4.2f}x)  "
              f"{bl * 1e3:12.1f} ({bl / pl:4.2f}x)  {r['push'][1] * 1e3:13.1f}  "
              f"{r['saveload'][1] * 1e3:19.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
