"""End to end: a job that checkpoints itself with dcp.async_save through
snapshotter.checkpoint is frozen with CRIU (its staging memfds and all) and thawed; its saves
go on through the node agent after the thaw, and it ends bit-identical to an uninterrupted
run. `snapshotter list --checkpoints` shows every save and nothing half-made."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import skip_without_criu
from tests.support.cli import ROOT, SnapCli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
EXAMPLE = ROOT / "examples" / "train_dcp_async.py"
# 80 steps of at least 0.1 s: the freeze must land before the job ends, also when a loaded
# machine takes seconds to start the CLI (at 40 steps a job once finished first).
STEPS = 80
ARGS = ("--steps", str(STEPS), "--save-every", "5", "--width", "256", "--step-sleep", "0.1")


def _run(snap: SnapCli, out: Path, name: str) -> str:
    p = snap.run("run", "--detach", "--nproc-per-node", "2", str(EXAMPLE), *ARGS,
                 "--name", name, "--out", str(out))  # fmt: skip
    return p.stdout.strip().splitlines()[-1]


def test_a_checkpointing_job_freezes_thaws_and_keeps_checkpointing(
    snap: SnapCli, tmp_path: Path
) -> None:
    skip_without_criu()
    ref, out = tmp_path / "ref.json", tmp_path / "out.json"
    st = snap.wait(_run(snap, ref, "ref"))
    assert st["state"] == "SUCCEEDED", st
    reference = json.loads(ref.read_text())
    assert reference["via_agent"] is True

    job = _run(snap, out, "run")
    snap.wait_step(job, 12)
    snapshot = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    assert snap.json("status", job)["state"] == "FROZEN"
    assert snap.last_step(job) < STEPS
    snap.run("thaw", snapshot)
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    result = json.loads(out.read_text())
    assert result["losses"] == reference["losses"]
    assert result["digest"] == reference["digest"]
    # Both runs saved every 5 steps, the second also after its thaw.
    listed = snap.json("list", "--checkpoints")["checkpoints"]
    names = sorted(c["name"] for c in listed)
    assert names == [f"{n}-{s:06d}" for n in ("ref", "run") for s in range(5, STEPS + 1, 5)], names
    assert all(c["ranks"] == 2 for c in listed)
