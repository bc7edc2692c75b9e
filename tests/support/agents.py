"""Node agents and a coordinator in this process, for real: each agent serves gRPC on a unix
socket, and they reach each other (and the coordinator them) through it. Jobs run under
them as real processes. For what needs several nodes but no network namespaces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from snapshotter import __version__
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.fencing import Fence
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.config import Paths
from snapshotter.coordinator.core import Coordinator
from snapshotter.rpc import relay
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import Listen, serve
from snapshotter.rpc.tls import TlsFiles
from snapshotter.storage import LocalDirStore
from snapshotter.v1 import common_pb2
from snapshotter.v1 import coordinator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(
        self, tmp: Path, nodes: tuple[str, ...], script: Path, tcp: bool = False
    ) -> None:
        """`tcp`: agents serve 127.0.0.1 with mutual TLS (certificates as `snapshotter
        certs init` makes them), as across nodes; else each a unix socket."""
        self.script = script
        url = f"file://{tmp / 'store'}"
        tls_dir = tmp / "tls"
        if tcp:
            subprocess.run(
                [sys.executable, "-m", "snapshotter", "certs", "init", str(tls_dir),
                 "--nodes", ",".join(nodes)],
                check=True, capture_output=True, cwd=ROOT, timeout=60,
            )  # fmt: skip
        coord_tls = TlsFiles.in_dir(tls_dir, "coordinator") if tcp else None
        store = LocalDirStore(tmp / "store")
        self.tmp = tmp
        self.agents: dict[str, NodeAgent] = {}
        # Each node's fence (agent/fencing.py) and what it accepts from relays (rpc/relay.py),
        # as `snapshotter agent` sets them up.
        self.fences: dict[str, Fence] = {}
        self.trust: dict[str, relay.Trust] = {}
        self.servers = []
        self.address: dict[str, str] = {}
        self.coord = Coordinator(
            store, url, lambda address, name: Target(address, tls=coord_tls, server_name=name)
        )
        for name in nodes:
            tls = TlsFiles.in_dir(tls_dir, f"nodes/{name}") if tcp else None
            settings = NodeSettings(name=name, paths=Paths(tmp / name), freeze_lease_s=0,
                                    policy=ExecPolicy(anything=True), store_url=url,
                                    peer_tls=tls)  # fmt: skip
            node = NodeAgent(settings, store)
            where = "127.0.0.1:0" if tcp else f"unix:{node.paths.run_dir / 'agent.sock'}"
            fence = self.fences[name] = Fence()
            trust = self.trust[name] = relay.Trust(name)
            srv = serve("agent", Listen(where, tls=tls), agent_service.register(node),
                        [agent_service.SERVICE], extra_check=agent_service.fence_check(fence),
                        trust=trust)  # fmt: skip
            self.servers.append(srv)
            self.address[name] = srv.address
            node.weights.attach(self.coord.weights)
            reply = self.coord.register_agent(pb.RegisterAgentRequest(
                name=name, address=srv.address, host="127.0.0.1",
                incarnation=node.incarnation, version=__version__))  # fmt: skip
            trust.learn(reply.relay_key)
            self.agents[name] = node

    def run(self, job_id: str, node: str, *args: str, tenant: str = "") -> str:
        st = self.coord.run(pb.RunRequest(
            tenant=tenant,
            job_id=job_id, script=str(self.script), python=sys.executable, cwd=str(self.tmp),
            script_args=[*args, "--out", str(self.tmp / f"{job_id}.json")],
            env={"PATH": "/usr/bin", "PYTHONPATH": str(ROOT)}, nnodes=1, nproc_per_node=1,
            nodes=[node]))  # fmt: skip
        return st.job_id

    def wait(self, job_id: str, timeout: float = 300) -> dict:
        st = self.coord.wait(job_id, timeout)
        assert st.state == "SUCCEEDED", (st, self.log(job_id))
        return dict(json.loads((self.tmp / f"{job_id}.json").read_text()))

    def log(self, job_id: str) -> str:
        chunks = self.coord.logs(common_pb2.LogsRequest(job_id=job_id))
        return b"".join(c.data for c in chunks).decode(errors="replace")[-3000:]

    def close(self) -> None:
        for job_id in self.coord.running_jobs():
            self.coord.cancel(job_id)
        for srv in self.servers:
            srv.stop(0)
        for node in self.agents.values():
            node.shutdown()
