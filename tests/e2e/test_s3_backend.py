"""End to end through the S3 backend, against a real SeaweedFS server started by the tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import SnapCli, read_result
from tests.support.seaweed import SeaweedServer, seaweed_server  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.s3, pytest.mark.timeout(600)]

ARGS = ("--steps", "200", "--step-sleep", "0.03")


def test_freeze_stop_thaw_through_s3(
    tmp_path: Path,
    seaweed_server: SeaweedServer,  # noqa: F811 - the fixture imported above
    make_snap: Callable[..., SnapCli],
) -> None:
    env = {**seaweed_server.env(), "SNAPSHOTTER_STORE": f"s3://{seaweed_server.bucket}/e2e"}
    cli = make_snap(env)
    ref = tmp_path / "ref.json"
    assert cli.wait(cli.start_job(ref, *ARGS))["state"] == "SUCCEEDED"

    out = tmp_path / "out.json"
    job = cli.start_job(out, *ARGS)
    cli.wait_step(job, 40)
    res = cli.json("freeze", job, "--stop")
    snapshot = res["snapshot_id"]
    assert cli.json("status", job)["state"] == "FROZEN"

    keys = seaweed_server.keys("e2e/")
    assert f"e2e/snapshots/{snapshot}/manifest.json" in keys
    assert sum(1 for k in keys if k.startswith("e2e/chunks/")) >= 2  # shared chunks (format 2)
    assert not (tmp_path / "home" / "store").exists()  # nothing went to the local default

    assert cli.run("thaw", snapshot).stdout.strip().splitlines()[-1] == job
    st = cli.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == read_result(ref)

    # Freeze-and-continue through S3 as well.
    out2 = tmp_path / "out2.json"
    job2 = cli.start_job(out2, *ARGS)
    cli.wait_step(job2, 40)
    assert cli.json("freeze", job2)["stopped"] is False
    assert cli.wait(job2)["state"] == "SUCCEEDED"
    assert read_result(out2) == read_result(ref)
