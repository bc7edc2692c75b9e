"""The snapshotter demo: freeze a running 2-rank DDP job mid-run, thaw it, and show that it
finishes with exactly the parameters of an uninterrupted run.

It only uses the `snapshotter` command line, as a user would, on the embedded default (local
coordinator + agent started in the background, snapshots in a local directory).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_ddp.py"
STEPS = 300


def sh(*args: str, capture: bool = True) -> str:
    cmd = ["snapshotter", *args]
    print(f"\n$ {shlex.join(cmd)}", flush=True)
    p = subprocess.run(
        [sys.executable, "-m", "snapshotter", *args],
        text=True,
        stdout=subprocess.PIPE if capture else None,
    )
    if p.returncode != 0:
        raise SystemExit(f"demo: `{shlex.join(cmd)}` failed with exit code {p.returncode}")
    if capture:
        print(p.stdout, end="", flush=True)
        return p.stdout
    return ""


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def wait_for_step(job: str, step: int, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-m", "snapshotter", "logs", job, "--rank", "0"],
            text=True,
            capture_output=True,
        ).stdout
        steps = re.findall(r"rank 0 step (\d+) ", out)
        if steps and int(steps[-1]) >= step:
            return int(steps[-1])
        time.sleep(0.5)
    raise SystemExit(f"demo: job {job} did not reach step {step} within {timeout}s")


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="snapshotter-demo-"))
    ref_out, frozen_out = work / "uninterrupted.json", work / "frozen-and-thawed.json"
    args = ["--steps", str(STEPS), "--step-sleep", "0.03"]

    print("== 1. An uninterrupted run of the job, for reference")
    ref = last_line(
        sh("run", "--detach", "--nproc-per-node", "2", str(TRAIN), *args, "--out", str(ref_out))
    )
    sh("wait", ref)

    print("\n== 2. The same job, frozen mid-run with --stop, then thawed")
    job = last_line(
        sh("run", "--detach", "--nproc-per-node", "2", str(TRAIN), *args, "--out", str(frozen_out))
    )
    at = wait_for_step(job, STEPS // 3)
    print(f"   job {job} is at step {at} of {STEPS}", flush=True)
    snapshot = last_line(sh("freeze", job, "--stop"))
    sh("status", job)
    sh("list")
    print("   ...the job's processes are gone; its state lives in the snapshot.", flush=True)
    sh("thaw", snapshot)
    sh("wait", job)

    a, b = json.loads(ref_out.read_text()), json.loads(frozen_out.read_text())
    print("\n== 3. Result")
    print(f"   uninterrupted      : digest {a['digest']}  loss {a['loss']:.6f}")
    print(f"   frozen + thawed    : digest {b['digest']}  loss {b['loss']:.6f}")
    same = a == b
    print("   bit-identical final parameters: " + ("YES" if same else "NO"), flush=True)
    if os.environ.get("SNAPSHOTTER_DEMO_KEEP") != "1":
        sh("down")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
