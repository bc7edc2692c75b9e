"""A real coordinator on a real gRPC server (loopback, bearer tokens, an audit log) driving a
real node agent that runs real processes, with one running job and one committed snapshot for
each of two tenants: what the tenant and provider-API tests act on."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapshotter import __version__
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.config import Paths
from snapshotter.coordinator import service as coordinator_service
from snapshotter.coordinator.core import Coordinator
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import audit
from snapshotter.rpc.auth import Role, TokenStore
from snapshotter.rpc.client import Client, Target, coordinator_client
from snapshotter.rpc.server import Listen, Served, serve
from snapshotter.storage import LocalDirStore, SnapshotWriter
from snapshotter.v1 import coordinator_pb2

pb = coordinator_pb2
SLEEPER = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
TENANTS = ("acme", "globex")


@dataclass
class Cluster:
    address: str
    tokens: TokenStore
    audit_log: Path
    jobs: dict[str, str]  # tenant -> its job id
    snaps: dict[str, str]  # tenant -> its snapshot id
    coord: Coordinator
    script: Path
    store: LocalDirStore
    tmp: Path

    def client(self, token: str) -> Client:
        return coordinator_client(Target(self.address, token=token))

    def plant(self, tenant: str, sid: str) -> str:
        """Commit one more snapshot `sid` of `tenant`'s job; returns `sid`."""
        spec = JobSpec(job_id=self.jobs[tenant], script=str(self.script), script_args=[],
                       module=False, python=sys.executable, cwd=str(self.tmp), env={},
                       tenant=tenant)  # fmt: skip
        _snapshot(self.store, sid, spec, self.tmp)
        return sid


def _snapshot(store: LocalDirStore, sid: str, spec: JobSpec, tmp: Path) -> None:
    src = tmp / sid
    src.mkdir()
    (src / "core-1.img").write_bytes(os.urandom(2000))
    with SnapshotWriter(store, sid) as w:
        w.add_directory("rank-0", src)
        job, _ = spec.for_snapshot()
        w.commit({"job": job, "source_job": spec.job_id, "nodes": ["n0"], "ranks": []})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("tenants")
    store = LocalDirStore(tmp / "store")
    node = NodeAgent(NodeSettings(name="n0", paths=Paths(tmp / "agent"), freeze_lease_s=0,
                                  policy=ExecPolicy(anything=True)), store)  # fmt: skip
    servers: list[Served] = []
    try:
        sock = node.paths.run_dir / "agent.sock"
        servers.append(serve("agent", Listen(f"unix:{sock}"), agent_service.register(node),
                             [agent_service.SERVICE]))  # fmt: skip
        coord = Coordinator(store, f"file://{tmp / 'store'}",
                            lambda address, name: Target(address, server_name=name))  # fmt: skip
        coord.register_agent(pb.RegisterAgentRequest(
            name="n0", address=f"unix:{sock}", host="127.0.0.1",
            incarnation=node.incarnation, version=__version__))  # fmt: skip
        tokens = TokenStore(tmp / "tokens.json")
        log = tmp / "audit.log"
        srv = serve("coordinator", Listen("127.0.0.1:0", tokens=tokens),
                    coordinator_service.register(coord), [coordinator_service.SERVICE],
                    audit=audit.AuditLog(log))  # fmt: skip
        servers.append(srv)
        script = tmp / "sleeper.py"
        script.write_text(SLEEPER)
        c = Cluster(srv.address, tokens, log, {}, {}, coord, script, store, tmp)
        for tenant in ("acme", "globex"):
            op = c.client(tokens.create(f"{tenant}-ops", Role.OPERATOR, None, tenant=tenant))
            st = op.stub.Run(pb.RunRequest(
                script=str(script), python=sys.executable, cwd=str(tmp), env={"PATH": "/usr/bin"},
                nnodes=1, nproc_per_node=1), timeout=120)  # fmt: skip
            assert st.tenant == tenant and st.state == "RUNNING", st
            c.jobs[tenant] = st.job_id
            c.snaps[tenant] = c.plant(tenant, f"{st.job_id}-s1")
        yield c
    finally:
        for s in servers:
            s.stop(0)
        node.shutdown()


