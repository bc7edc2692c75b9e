"""Jobs on the trainers people use, frozen and thawed: a Hugging Face Transformers `Trainer`
(DDP with find_unused_parameters, as the Trainer sets it, a DataLoader worker), a plain
Accelerate loop and an FSDP2 (`fully_shard`) loop. Each is frozen-and-continued, loses a rank,
is thawed from that snapshot, frozen again with --stop, thawed again, and finishes
bit-identical to an uninterrupted run of the same script under plain torchrun."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.support.cli import ROOT, SnapCli, torchrun_digest
from tests.support.soak import rank_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
JOBS = ROOT / "tests" / "support" / "jobs"


@pytest.mark.parametrize(
    ("script", "steps"),
    [("hf_trainer.py", "200"), ("accelerate_loop.py", "240"), ("fsdp2_train.py", "240")],
    ids=["transformers-trainer", "accelerate", "fsdp2"],
)
def test_trainer_frozen_twice_and_thawed_finishes_like_torchrun(
    snap: SnapCli, tmp_path: Path, script: str, steps: str
) -> None:
    needs = {"hf_trainer.py": "transformers", "accelerate_loop.py": "accelerate"}
    pytest.importorskip(needs.get(script, "torch"))
    reference = torchrun_digest(JOBS / script, tmp_path / "ref.json", steps, tmp_path)

    out = tmp_path / "live.json"
    # Paced so that it is still running after two freezes, a kill and a thaw on a slow
    # machine (the pause between steps changes nothing it computes).
    p = snap.run("run", "--detach", "--nproc-per-node", "2", str(JOBS / script),
                 "--out", str(out), "--steps", steps, "--step-sleep", "0.1")  # fmt: skip
    job = p.stdout.strip().splitlines()[-1]
    snap.wait_step(job, 30, timeout=300)
    kept = snap.run("freeze", job).stdout.strip().splitlines()[-1]  # freeze-and-continue
    snap.wait_step(job, snap.last_step(job) + 10)
    init = next(r["pid"] for r in snap.json("status", job)["ranks"] if r["rank"] == 1)
    rank = rank_process(init)
    assert rank is not None
    os.kill(rank, signal.SIGKILL)
    assert snap.wait(job)["state"] == "FAILED"

    assert snap.json("thaw", kept)["job_id"] == job
    snap.wait_step(job, snap.last_step(job) + 10)
    stopped = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    assert snap.json("status", job)["state"] == "FROZEN"
    assert snap.json("thaw", stopped)["job_id"] == job
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert json.loads(out.read_text())["digest"] == reference
