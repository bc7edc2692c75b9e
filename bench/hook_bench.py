"""Benchmark: what the in-rank hook costs a job between freezes.

Step time under `snapshotter run` (the hook counts every collective) / step time of the same
job under plain torchrun, for three workloads of bench/hook_job.py on 2 CPU ranks over gloo:

  ddp-few    DDP, default 25 MB gradient buckets (1 allreduce a step)
  ddp-many   DDP, 0.05 MB buckets (12 allreduces a step)
  ddp-tiny   DDP, 64-wide layers in 0.01 MB buckets (24 allreduces a step, little compute)
  fsdp2      FSDP2 fully_shard per layer (all-gathers and reduce-scatters, ~36 a step)

Three arms a round: plain torchrun, the hook on its native path (csrc/gate.cpp, the default) and
the hook on its Python fallback (SNAPSHOTTER_NATIVE_HOOK=0; --no-python-path skips it). The order
rotates per round; each run reports its median step time after a warm-up; the table gives the
medians over the rounds and the median of the per-round ratios to torchrun (target <= 1.01).
These machines are shared and noisy: read the ratio, not the milliseconds.

Usage: python bench/hook_bench.py [--pairs 5] [--steps 300] [--no-python-path] [--json out.json]
Needs the README's install (deploy/install.sh --with-job-deps); no CRIU dump is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.cli import SnapCli  # noqa: E402 - the harness tests and bench share

JOB = ROOT / "bench" / "hook_job.py"
WORKLOADS: dict[str, list[str]] = {
    "ddp-few": ["--mode", "ddp", "--bucket-mb", "25"],
    "ddp-many": ["--mode", "ddp", "--bucket-mb", "0.05"],
    # Little compute under many small buckets: the collectives' overhead is most of the step.
    "ddp-tiny": ["--mode", "ddp", "--bucket-mb", "0.01", "--width", "64"],
    "fsdp2": ["--mode", "fsdp2"],
}


def _result(text: str) -> dict[str, Any]:
    found = re.findall(r"^RESULT (.*)$", text, re.M)
    if not found:
        raise RuntimeError(f"no RESULT line in:\n{text[-3000:]}")
    data: dict[str, Any] = json.loads(found[-1])
    return data


def plain(args: list[str], cwd: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER")}
    torchrun = Path(sys.executable).with_name("torchrun")
    p = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(JOB), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    return _result(p.stdout)


def hooked(cli: SnapCli, args: list[str]) -> dict[str, Any]:
    p = cli.run("run", "--detach", "--nproc-per-node", "2", str(JOB), *args)
    job = p.stdout.strip().splitlines()[-1]
    st = cli.wait(job, timeout=900)
    if st["state"] != "SUCCEEDED":
        raise RuntimeError(f"hooked run {job} ended {st['state']}: {cli.log_path(job)}")
    return _result(cli.log_path(job).read_text(errors="replace"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--no-python-path", action="store_true",
                    help="skip the hook's Python fallback (SNAPSHOTTER_NATIVE_HOOK=0)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="hook-bench-") as tmp:
        work = Path(tmp)
        clis = {"native": SnapCli(work / "home")}
        if not a.no_python_path:
            clis["python"] = SnapCli(work / "home-py", {"SNAPSHOTTER_NATIVE_HOOK": "0"})
        try:
            for name, wargs in WORKLOADS.items():
                if a.workload not in (name, "all"):
                    continue
                args = [*wargs, "--steps", str(a.steps)]
                arms = ["torchrun", *clis]
                runs: dict[str, list[float]] = {arm: [] for arm in arms}
                per_step = None
                for i in range(a.pairs):
                    # Each round runs every arm once, in an order that rotates per round.
                    order = arms[i % len(arms):] + arms[: i % len(arms)]
                    for arm in order:
                        r = plain(args, work) if arm == "torchrun" else hooked(clis[arm], args)
                        runs[arm].append(r["median_step_ms"])
                        if arm != "torchrun":
                            per_step = r.get("collectives_per_step")
                    print(f"[{name}] round {i + 1}/{a.pairs}: " + ", ".join(
                        f"{arm} {runs[arm][-1]:.3f} ms" for arm in arms), flush=True)  # fmt: skip
                entry: dict[str, Any] = {"collectives_per_step": per_step}
                for arm in arms:
                    entry[f"{arm}_ms"] = round(statistics.median(runs[arm]), 3)
                for arm in clis:
                    ratios = [h / p for p, h in zip(runs["torchrun"], runs[arm], strict=True)]
                    entry[f"{arm}_ratio_median"] = round(statistics.median(ratios), 3)
                    entry[f"{arm}_ratios"] = [round(r, 3) for r in ratios]
                report[name] = entry
        finally:
            for cli in clis.values():
                cli.close()
    cols = ["native", *(["python"] if not a.no_python_path else [])]
    print(f"\n{'workload':<10} {'coll/step':>9} {'torchrun ms':>12} "
          + " ".join(f"{c + ' ms':>10} {c + ' ratio':>13}" for c in cols))  # fmt: skip
    for name, r in report.items():
        print(f"{name:<10} {r['collectives_per_step']!s:>9} {r['torchrun_ms']:>12.3f} "
              + " ".join(f"{r[c + '_ms']:>10.3f} {r[c + '_ratio_median']:>13.3f}"
                         for c in cols))  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
