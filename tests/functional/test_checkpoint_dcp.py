"""Application checkpoints through snapshotter storage, for real: torch.distributed.checkpoint's
own async_save and load with snapshotter.checkpoint's writer and reader, two gloo ranks under
torchrun, on a local directory and on S3 (SeaweedFS); a save killed halfway; and the node agent
doing the uploads for the ranks it runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import __version__
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.checkpoint import catalog
from snapshotter.config import Paths
from snapshotter.coordinator.core import Coordinator
from snapshotter.coordinator.gc import checkpoint_gc_report
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import Listen, serve
from snapshotter.storage import LocalDirStore
from snapshotter.storage.url import open_store
from snapshotter.v1 import coordinator_pb2
from tests.support.seaweed import SeaweedServer

pb = coordinator_pb2
pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_dcp_async.py"


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SNAPSHOTTER_", "AWS_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _torchrun(env: dict[str, str], *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--width", "256", *args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store_env(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str]]:
    if request.param == "local":
        url = f"file://{tmp_path / 'store'}"
        return url, _env({"SNAPSHOTTER_STORE": url})
    server: SeaweedServer = request.getfixturevalue("seaweed_server")
    url = f"s3://{server.bucket}/ckpt-{os.urandom(6).hex()}"
    return url, _env({"SNAPSHOTTER_STORE": url, **server.env()})


def test_async_save_then_load_continues_bit_identically(
    store_env: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    url, env = store_env
    whole, first, resumed = (tmp_path / f"{n}.json" for n in ("whole", "first", "resumed"))
    _torchrun(env, "--steps", "12", "--save-every", "4", "--out", str(whole))
    # The same training interrupted after step 8, then resumed from the newest checkpoint
    # of a store of its own.
    url2 = url + "-2" if url.startswith("s3") else url.replace("store", "store2")
    env2 = {**env, "SNAPSHOTTER_STORE": url2}
    _torchrun(env2, "--steps", "8", "--save-every", "4", "--out", str(first))
    _torchrun(env2, "--steps", "12", "--save-every", "4", "--resume", "--out", str(resumed))
    w, f, r = (json.loads(p.read_text()) for p in (whole, first, resumed))
    assert r["start"] == 8 and len(w["stalls"]) == 3
    assert f["losses"] + r["losses"] == w["losses"]
    assert r["digest"] == w["digest"]
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    listed = catalog.list_checkpoints(catalog.checkpoint_store(url))
    assert [c.name for c in listed] == ["step-000004", "step-000008", "step-000012"]
    assert all(len(c.parts) == 2 and c.raw_bytes > 0 for c in listed)


SAVER = """\
import sys, time, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from snapshotter.checkpoint import writer
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % int(sys.argv[1]),
                        rank=0, world_size=1)
w = writer()
dcp.async_save({"small": torch.arange(1000)}, storage_writer=w, checkpoint_id="c1").result()
big = {"big": torch.randn(64 * 1024 * 1024)}  # 256 MiB of noise: seconds to upload here
fut = dcp.async_save(big, storage_writer=w, checkpoint_id="c2")
print("staged", flush=True)
fut.result()
print("saved", flush=True)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_save_killed_halfway_is_never_visible_and_gc_reclaims_it(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    proc = subprocess.Popen([sys.executable, str(script), str(_free_port())],
                            env=_env({"SNAPSHOTTER_STORE": url}), stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "staged"
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and its uploader, mid-upload
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    store = catalog.checkpoint_store(url)
    assert [c.name for c in catalog.list_checkpoints(store)] == ["c1"]
    assert catalog.latest(store) == "c1"
    # gc (grace period 0, as if long after) deletes what the killed save left: its part if
    # it got that far, and every chunk only it used.
    report = checkpoint_gc_report(open_store(url), now=time.time() + 5, min_age_s=0,
                                  delete=True)  # fmt: skip
    assert report["summary"]["failed"] == 0 and report["chunks"]["failed"] == 0
    kept = set().union(*(catalog.read_manifest(store, sid).content_keys()
                         for sid in ("c1", "c1.part00000")))  # fmt: skip
    assert set(store.list_keys("chunks/")) == kept
    assert sorted(os.listdir(tmp_path / "store/checkpoints/snapshots")) == ["c1", "c1.part00000"]


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Coordinator, NodeAgent, str]]:
    url = f"file://{tmp_path / 'store'}"
    store = LocalDirStore(tmp_path / "store")
    settings = NodeSettings(name="n0", paths=Paths(tmp_path / "agent"), freeze_lease_s=0,
                            policy=ExecPolicy(anything=True), store_url=url)  # fmt: skip
    node = NodeAgent(settings, store)
    sock = node.paths.run_dir / "agent.sock"
    srv = serve("agent", Listen(f"unix:{sock}"), agent_service.register(node),
                [agent_service.SERVICE])  # fmt: skip
    try:
        coord = Coordinator(store, url, lambda address, name: Target(address, server_name=name))
        coord.register_agent(pb.RegisterAgentRequest(
            name="n0", address=f"unix:{sock}", host="127.0.0.1",
            incarnation=node.incarnation, version=__version__))  # fmt: skip
        yield coord, node, url
    finally:
        srv.stop(0)
        node.shutdown()


def test_the_node_agent_uploads_sealed_checkpoints_for_its_ranks_and_opens_them(
    agent: tuple[Coordinator, NodeAgent, str], tmp_path: Path
) -> None:
    coord, node, url = agent
    assert coord.encrypt  # the default: tenants' data sealed at rest

    def job(job_id: str, out: Path, *args: str) -> dict:
        st = coord.run(pb.RunRequest(
            job_id=job_id, script=str(EXAMPLE), python=sys.executable, cwd=str(tmp_path),
            script_args=["--save-every", "4", "--width", "256", "--out", str(out), *args],
            env={"PATH": "/usr/bin", "PYTHONPATH": str(ROOT)}, nnodes=1,
            nproc_per_node=2))  # fmt: skip
        st = coord.wait(st.job_id, 200)
        assert st.state == "SUCCEEDED", st
        return dict(json.loads(out.read_text()))

    first = job("dcp", tmp_path / "first.json", "--steps", "8")
    assert first["via_agent"] is True
    # Two parts and a commit per save, each carried out by the agent, none by a rank's child.
    assert node.checkpoints.handled == 2 * 3
    store = catalog.checkpoint_store(url)
    assert [c.name for c in catalog.list_checkpoints(store)] == ["step-000004", "step-000008"]
    for sid in ("step-000008", "step-000008.part00000", "step-000008.part00001"):
        sealing = catalog.read_manifest(store, sid).sealed
        assert sealing is not None and sealing.tenant == "default", sid
    # Sealed: nothing outside the tenant's jobs opens it (the key never leaves the agents).
    with pytest.raises(AssertionError, match="sealed under tenant 'default'"):
        _load_model(url)
    # A job of the tenant resumes from it through its agent, and trains on bit-identically.
    resumed = job("dcp2", tmp_path / "resumed.json", "--steps", "12", "--resume",
                  "--name", "more")  # fmt: skip
    whole = tmp_path / "whole.json"
    _torchrun(_env({"SNAPSHOTTER_STORE": f"file://{tmp_path / 'plain'}"}), "--steps", "12",
              "--save-every", "100", "--out", str(whole))  # fmt: skip
    assert resumed["start"] == 8
    assert resumed["digest"] == json.loads(whole.read_text())["digest"]
    assert [c.name for c in catalog.list_checkpoints(store)][-1] == "more-000012"


LOADER = """\
import json, sys, torch, torch.distributed.checkpoint as dcp
sys.path.insert(0, sys.argv[2])
from examples.train_dcp_async import digest
from snapshotter.checkpoint import reader
net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
state = {"model": net.state_dict()}
dcp.load(state, storage_reader=reader(sys.argv[1]), no_dist=True)
net.load_state_dict(state["model"])
print(digest(net))
"""


def _load_model(url: str) -> str:
    proc = subprocess.run([sys.executable, "-c", LOADER, url, str(ROOT)], env=_env({}),
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]
