"""Benchmark: what a freeze costs the job, and what a thaw saves over a cold restart.

For the 2-rank CPU DDP job of examples/train_ddp.py, measured side by side in one run, several
rounds, medians reported with ratios (these machines are shared and noisy; absolute numbers
mean little, ratios within one run do):

  freeze stall          time the ranks stood still in a freeze-and-continue (park .. resumed)
  dump                  CRIU dump of both ranks (inside the stall)
  freeze total          the whole `snapshotter freeze` incl. upload and commit
  thaw-to-first-step    `snapshotter thaw` start .. first new training step logged
  cold restart          relaunch of the same job + load of its application checkpoint ..
                        first new training step logged (what is done without snapshotter)

Usage: python bench/freeze_thaw_bench.py [--rounds 3] [--json out.json]
Needs root and CRIU (deploy/install.sh --with-job-deps).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.cli import SnapCli  # noqa: E402 - the harness tests and bench share

STEPS = 400
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.02")


def _steps_in(cli: SnapCli, job: str) -> list[int]:
    try:
        text = cli.log_path(job).read_text(errors="replace")
    except OSError:
        return []
    return [int(s) for s in re.findall(r"rank 0 step (\d+) ", text)]


def _wait_new_step(cli: SnapCli, job: str, after: int, seen: int, timeout: float = 300) -> float:
    """Time at which a step line beyond `after` appears past the first `seen` lines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = _steps_in(cli, job)
        if len(steps) > seen and steps[-1] > after:
            return time.monotonic()
        time.sleep(0.01)
    raise RuntimeError(f"job {job} made no progress after step {after}")


def one_round(cli: SnapCli, work: Path, i: int) -> dict[str, float]:
    r: dict[str, float] = {}
    # Freeze-and-continue: the stall the running job sees.
    job = cli.start_job(work / f"a{i}.json", *ARGS)
    cli.wait_step(job, 50)
    res = cli.json("freeze", job)
    r["freeze_stall_s"] = res["stats"]["stall_s"]
    r["dump_s"] = res["stats"]["dump_s"]
    r["freeze_total_s"] = res["stats"]["total_s"]
    r["image_mb"] = res["stats"]["image_bytes"] / 2**20

    # Freeze --stop, then thaw: time until training goes on.
    snap = cli.json("freeze", job, "--stop")["snapshot_id"]
    frozen_at = cli.last_step(job)
    seen = len(_steps_in(cli, job))
    t0 = time.monotonic()
    cli.run("thaw", snap)
    r["thaw_to_first_step_s"] = _wait_new_step(cli, job, frozen_at, seen) - t0
    cli.run("cancel", job)

    # Cold restart of the same job from its application checkpoint.
    ckpt = work / f"ckpt{i}.pt"
    job2 = cli.start_job(work / f"b{i}.json", *ARGS, "--ckpt", str(ckpt), "--ckpt-every", "10")
    cli.wait_step(job2, 60)
    cli.run("cancel", job2)
    t0 = time.monotonic()
    job3 = cli.start_job(
        work / f"c{i}.json", *ARGS, "--ckpt", str(ckpt), "--ckpt-every", "10", "--resume"
    )
    _wait_new_step(cli, job3, 0, 0)
    r["cold_restart_s"] = time.monotonic() - t0
    cli.run("cancel", job3)
    return r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="snapshotter-bench-"))
    cli = SnapCli(work / "home")
    rounds = []
    try:
        for i in range(a.rounds):
            rounds.append(one_round(cli, work, i))
            print(
                f"round {i + 1}: " + ", ".join(f"{k}={v:.3f}" for k, v in rounds[-1].items()),
                flush=True,
            )
    finally:
        cli.close()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratios = {
        "thaw_to_first_step / cold_restart": med["thaw_to_first_step_s"] / med["cold_restart_s"],
        "freeze_stall / cold_restart": med["freeze_stall_s"] / med["cold_restart_s"],
        "dump / freeze_stall": med["dump_s"] / med["freeze_stall_s"],
    }
    print(f"\nmedians over {a.rounds} rounds (2 ranks, CPU DDP, local directory store):")
    for k, v in med.items():
        print(f"  {k:24s} {v:8.3f}")
    print("ratios (same run):")
    for k, v in ratios.items():
        print(f"  {k:36s} {v:6.3f}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"rounds": rounds, "median": med, "ratios": ratios}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
