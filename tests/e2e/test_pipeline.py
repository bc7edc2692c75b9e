"""A 2-stage pipeline job exchanging isend/irecv every step (activations forward, gradients
back, a control message): 10 freezes in a row (SNAPSHOTTER_PIPELINE_FREEZES; longer series are
bench/soak_bench.py's) all succeed, wherever in its p2p exchange each rank happens to be, and the
job finishes bit-identical to the same run under plain torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import ROOT, SnapCli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
JOB = ROOT / "tests" / "support" / "jobs" / "pipeline.py"
FREEZES = int(os.environ.get("SNAPSHOTTER_PIPELINE_FREEZES", "10"))


def _digests(out: Path) -> list[dict[str, object]]:
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]


def test_many_freezes_of_a_pipeline_in_a_row(snap: SnapCli, tmp_path: Path) -> None:
    out, stop = tmp_path / "live", tmp_path / "stop"
    args = ("--out", str(out), "--steps", "1000000", "--stop-file", str(stop))
    p = snap.run("run", "--detach", "--nproc-per-node", "2", str(JOB), *args,
                 "--step-sleep", "0.002")  # fmt: skip
    job = p.stdout.strip().splitlines()[-1]
    snap.wait_step(job, 20)
    done = []
    for i in range(FREEZES):
        last = i == FREEZES - 1
        p = snap.run("freeze", job, *(["--stop"] if last else []), check=False)
        assert p.returncode == 0, f"freeze {i + 1} of {FREEZES} failed: {p.stderr}"
        done.append(p.stdout.strip().splitlines()[-1])
    assert len(set(done)) == FREEZES and len(snap.json("list")["snapshots"]) == FREEZES
    stop.touch()  # the job ends at its next multiple of 50 steps after the thaw
    assert snap.json("thaw", done[-1])["job_id"] == job
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    live = _digests(out)

    steps = str(live[0]["steps"])
    ref = tmp_path / "ref"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER")}
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", str(JOB),
                    "--out", str(ref), "--steps", steps],  # fmt: skip
                   cwd=tmp_path, env=env, check=True, timeout=600, capture_output=True)  # fmt: skip
    assert live == _digests(ref)
