"""The control plane as others see it: a client generated from the .proto files alone, in its
own process, drives the embedded daemon; and a secret in a job's environment reaches no
stored metadata."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import SnapCli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
ARGS = ("--steps", "100000", "--step-sleep", "0.03")

# A client that knows nothing of snapshotter but the generated code: no project stubs, no
# version header, only the contract.
CLIENT = r"""
import json, sys
import grpc
from snapshotter.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc

address, job = sys.argv[1], sys.argv[2]
stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(address))
jobs = stub.Jobs(common_pb2.Empty(), timeout=60)
print(json.dumps({"jobs": [j.job_id for j in jobs.jobs],
                  "state": {j.job_id: j.state for j in jobs.jobs}}))
for ev in stub.Freeze(coordinator_pb2.FreezeRequest(job_id=job), timeout=300):
    kind = ev.WhichOneof("event")
    if kind == "phase":
        print(json.dumps({"phase": ev.phase.phase}))
    elif kind == "progress":
        print(json.dumps({"progress": ev.progress.raw_bytes}))
    else:
        print(json.dumps({"done": ev.done.snapshot_id, "image_bytes": ev.done.stats.image_bytes}))
"""


def test_a_client_generated_from_the_proto_files_lists_jobs_and_streams_a_freeze(
    snap: SnapCli, tmp_path: Path
) -> None:
    gen = tmp_path / "gen"
    gen.mkdir()
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"-I{include}",
         f"--python_out={gen}", f"--grpc_python_out={gen}",
         *map(str, sorted((ROOT / "proto").glob("snapshotter/v1/*.proto")))],
        check=True, timeout=120,
    )  # fmt: skip
    (tmp_path / "client.py").write_text(CLIENT)
    job = snap.start_job(tmp_path / "out.json", *ARGS)
    snap.wait_step(job, 10)
    address = json.loads((snap.home / "daemon.json").read_text())["coordinator"]
    # -S: no site, so nothing of this checkout (its editable install) is importable; grpcio
    # and protobuf come from site-packages by path, the contract's code from `gen` only.
    site = sysconfig.get_paths()["purelib"]
    client = str(tmp_path / "client.py")
    boot = f"import sys; sys.path[:0] = [{str(gen)!r}, {site!r}]; exec(open({client!r}).read())"
    p = subprocess.run(
        [sys.executable, "-S", "-c", boot, address, job],
        capture_output=True, text=True, timeout=400, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert job in lines[0]["jobs"] and lines[0]["state"][job] == "RUNNING"
    phases = [ln["phase"] for ln in lines if "phase" in ln]
    assert phases[:4] == ["prepare", "quiesce", "suspend", "dump"] and "commit" in phases
    done = lines[-1]
    assert done["image_bytes"] > 0
    listed = [s["snapshot_id"] for s in snap.json("list")["snapshots"]]
    assert done["done"] in listed
    snap.run("cancel", job)


def test_a_secret_in_the_jobs_environment_reaches_no_stored_metadata(
    make_snap: Callable[..., SnapCli], tmp_path: Path
) -> None:
    """The manifest keeps only the variables that start the job's interpreter (KEPT_ENV) and
    names the others. The images themselves hold the ranks' memory, environment included:
    they are compressed, not encrypted (encryption at rest is its own step)."""
    marker = f"marker-{secrets.token_hex(16)}"
    snap = make_snap({"MY_SERVICE_TOKEN": marker})
    job = snap.start_job(tmp_path / "out.json", *ARGS)
    snap.wait_step(job, 10)
    sid = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    store = snap.home / "store"
    objects = [p for p in store.rglob("*") if p.is_file()]
    chunks = [p for p in objects if "/chunks/" in str(p)]
    metadata = [p for p in objects if p not in chunks]
    assert metadata and chunks
    for p in metadata:
        assert marker.encode() not in p.read_bytes(), f"{p} holds the secret"
    shown = snap.json("show", sid)
    assert "MY_SERVICE_TOKEN" in shown["env_omitted"]
    assert "MY_SERVICE_TOKEN" not in shown["job"]["env"] and "PATH" in shown["job"]["env"]
    # A thaw needs nothing that was left out: the job goes on where it was.
    st = snap.json("thaw", sid)
    assert snap.wait_step(st["job_id"], 20)
    snap.run("cancel", st["job_id"])
