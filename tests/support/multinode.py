"""A multi-node snapshotter deployment on one machine: a coordinator and node agents, each in
its own network namespace (tests/support/netns.py), driven through the real CLI.

    with Cluster(["ctl", "a", "b", "c"]) as cluster:
        dep = Deployment(cluster, tmp_path, store_url)
        dep.start(["a", "b", "c"])
        job = dep.cli.start_job(out, "--steps", "200", nnodes=2, nodes="a,b")

Each agent has its own SNAPSHOTTER_HOME (its work dirs, rank logs and sandbox dirs), all share
the snapshot store (a directory every namespace sees, or the S3 server on the bridge address).
Everything talks mutual TLS: the deployment makes its CA and certificates with the real
`snapshotter certs init` (coordinator, one per agent, an admin client for the CLI).
Processes are started with `Node.popen`, so `Cluster.close()` kills them, ranks included; the
deployment also stops them itself, by pid, when closed. Used by tests/e2e and bench/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from snapshotter.rpc.client import Target, agent_client, coordinator_client
from snapshotter.rpc.convert import plain
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import common_pb2
from tests.support.cli import TRAIN, SnapCli
from tests.support.netns import Cluster, _pids_in_netns, netns_unavailable
from tests.support.procs import CENSUS, children, dead

ROOT = Path(__file__).resolve().parents[2]
COORD_PORT = 7070
AGENT_PORT = 7071
# Their Prometheus endpoints: HTTPS with a client certificate (node addresses are not loopback).
COORD_METRICS_PORT = 9464
AGENT_METRICS_PORT = 9465


class MultiCli(SnapCli):
    """The CLI of an operator's machine (the root namespace) talking to the coordinator."""

    def __init__(self, dep: Deployment, home: Path, env: dict[str, str]) -> None:
        super().__init__(home, env)
        self.dep = dep

    def start_job(  # type: ignore[override]
        self,
        out: Path,
        *train_args: str,
        job_id: str | None = None,
        nproc: int = 2,
        nnodes: int = 2,
        nodes: str | None = None,
        script: Path = TRAIN,
    ) -> str:
        args = ["run", "--detach", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]
        args += ["--job-id", job_id] if job_id else []
        args += ["--nodes", nodes] if nodes else []
        p = self.run(*args, str(script), "--out", str(out), *train_args)
        return p.stdout.strip().splitlines()[-1]

    def _logs(self, job: str, rank: int) -> list[Path]:
        """This rank's log on every node it ran on, oldest first."""
        found = [
            p
            for name in self.dep.agents
            if (p := self.dep.home(name) / "jobs" / job / "logs" / f"rank-{rank}.log").exists()
        ]
        return sorted(found, key=lambda p: p.stat().st_mtime)

    def log_path(self, job: str, rank: int = 0) -> Path:
        """The newest log of this rank on any node (a thaw moves ranks to other nodes)."""
        logs = self._logs(job, rank)
        return logs[-1] if logs else self.dep.home(next(iter(self.dep.agents))) / "missing.log"

    def steps(self, job: str, rank: int = 0) -> list[int]:
        """Every step the rank logged, on every node it ran on, in order."""
        out: list[int] = []
        for p in self._logs(job, rank):
            out += [int(s) for s in re.findall(rf"rank {rank} step (\d+) ", p.read_text())]
        return out


class Deployment:
    def __init__(
        self,
        cluster: Cluster,
        root: Path,
        store_url: str,
        store_env: dict[str, str] | None = None,
        freeze_lease_s: float = 60.0,
        ctl: str = "ctl",
        relay_min: int | None = None,
    ) -> None:
        """`relay_min`: the coordinator's SNAPSHOTTER_RELAY_MIN (rpc/relay.py; None: its
        default, which no fan-out here reaches)."""
        self.cluster = cluster
        self.relay_min = relay_min
        self.root = root
        self.store_url = store_url
        self.store_env = dict(store_env or {})
        self.freeze_lease_s = freeze_lease_s
        self.ctl = cluster[ctl]
        self.coordinator = f"{self.ctl.ip}:{COORD_PORT}"
        self.agents: dict[str, subprocess.Popen[Any]] = {}
        self.coord_proc: subprocess.Popen[Any] | None = None
        self.tls_dir = root / "tls"
        env = {
            "SNAPSHOTTER_COORDINATOR": self.coordinator,
            "SNAPSHOTTER_TLS_DIR": str(self.tls_dir),
            **self.store_env,
        }
        self.cli = MultiCli(self, root / "cli-home", env)

    def make_certs(self) -> None:
        """The cluster's CA and certificates, through the real CLI (once per deployment)."""
        if (self.tls_dir / "ca.crt").exists():
            return
        nodes = ",".join(n.name for n in self.cluster if n is not self.ctl)
        subprocess.run(
            [sys.executable, "-m", "snapshotter", "certs", "init", str(self.tls_dir),
             "--nodes", nodes, "--client", "admin:admin", "--client", "viewer:viewer"],
            check=True, capture_output=True, cwd=ROOT, timeout=60,
        )  # fmt: skip

    def tls(self, name: str = "clients/admin") -> TlsFiles:
        return TlsFiles.in_dir(self.tls_dir, name)

    def home(self, node: str) -> Path:
        return self.root / f"home-{node}"

    def _env(self, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER_")}
        env.update(self.store_env)
        env.update({"SNAPSHOTTER_HOME": str(home), "PYTHONUNBUFFERED": "1",
                    "PYTHONPATH": str(ROOT),
                    # A stopping agent's drain: a 2x2 freeze-and-stop through S3 on a busy
                    # 2-core machine can outlast the 30 s default.
                    "SNAPSHOTTER_DRAIN_GRACE_S": "120"})  # fmt: skip
        return env

    # ---------------------------------------------------------------- services
    def start_coordinator(self) -> None:
        log = open(self.root / "coordinator.log", "ab")  # noqa: SIM115 - the child keeps it
        env = self._env(self.root / "coord-home")
        if self.relay_min is not None:
            env["SNAPSHOTTER_RELAY_MIN"] = str(self.relay_min)
        self.coord_proc = self.ctl.popen(
            [sys.executable, "-m", "snapshotter", "coordinator", "--listen", self.coordinator,
             "--store", self.store_url, "--agent-ttl", "6", "--tls-dir", str(self.tls_dir),
             "--metrics-listen", f"{self.ctl.ip}:{COORD_METRICS_PORT}"],
            env=env, stdout=log, stderr=log, cwd=ROOT,
        )  # fmt: skip
        log.close()
        CENSUS.keep(self.coord_proc.pid, "module", "multi-node deployment")
        self._wait(lambda: self.ping() is not None, "the coordinator to answer", self.coord_proc)

    def start_agent(self, name: str) -> None:
        node = self.cluster[name]
        log = open(self.root / f"agent-{name}.log", "ab")  # noqa: SIM115
        self.agents[name] = node.popen(
            [sys.executable, "-m", "snapshotter", "agent", "--listen", f"{node.ip}:{AGENT_PORT}",
             "--coordinator", self.coordinator, "--name", name, "--store", self.store_url,
             "--heartbeat", "1", "--freeze-lease", str(self.freeze_lease_s),
             "--tls-dir", str(self.tls_dir), "--allow-cwd", str(ROOT),
             "--metrics-listen", f"{node.ip}:{AGENT_METRICS_PORT}",
             *[f"--link={x}" for x in node.links]],
            env=self._env(self.home(name)), stdout=log, stderr=log, cwd=ROOT,
        )  # fmt: skip
        log.close()
        CENSUS.keep(self.agents[name].pid, "module", "multi-node deployment")
        agent = agent_client(
            Target(f"{node.ip}:{AGENT_PORT}", tls=self.tls(), server_name=name), peer="cli"
        )

        seen: dict[str, str] = {}

        def answers() -> bool:
            try:
                seen["incarnation"] = agent.stub.Ping(common_pb2.Empty(), timeout=3).incarnation
                return True
            except Exception:  # noqa: BLE001 - not up yet
                return False

        try:
            self._wait(answers, f"agent {name} to answer", self.agents[name])
        finally:
            agent.close()

        def registered() -> bool:  # this incarnation, not a predecessor at the same address
            info = self.ping()
            return info is not None and info["incarnations"].get(name) == seen["incarnation"]

        if self.coord_proc is not None and self.coord_proc.poll() is None:
            self._wait(registered, f"agent {name} to register", self.agents[name])

    def start(self, agents: list[str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.make_certs()
        self.start_coordinator()
        for a in agents:
            self.start_agent(a)
        self.wait_agents(agents)

    def wait_agents(self, names: list[str]) -> None:
        def ready() -> bool:
            info = self.ping()
            return info is not None and set(names) <= set(info["agents"])

        self._wait(ready, f"agents {names} to register", None)

    def metrics(self, node: str = "ctl", client: str | None = "clients/viewer"
                ) -> dict[str, float]:  # fmt: skip
        """The samples a service's metrics endpoint serves (the coordinator's for "ctl", else
        that node's agent's), through curl as a scraper with a client certificate would."""
        ip = self.cluster[node].ip
        name, port = ("coordinator", COORD_METRICS_PORT) if node == "ctl" else (node,
                                                                                AGENT_METRICS_PORT)
        tls = self.tls(client or "clients/viewer")
        mine = ["--cert", str(tls.cert), "--key", str(tls.key)] if client else []
        out = subprocess.run(
            ["curl", "-sS", "--fail", "--max-time", "20", "--cacert", str(tls.ca), *mine,
             "--resolve", f"{name}:{port}:{ip}", f"https://{name}:{port}/metrics"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if out.returncode != 0:
            raise AssertionError(f"curl of {name}'s metrics: {out.stderr.strip()}")
        return metric_samples(out.stdout)

    def ping(self, address: str | None = None) -> dict[str, Any] | None:
        c = coordinator_client(Target(address or self.coordinator, tls=self.tls()))
        try:
            return plain(c.stub.Ping(common_pb2.Empty(), timeout=3))
        except Exception:  # noqa: BLE001 - not up yet
            return None
        finally:
            c.close()

    def _wait(self, ok: Any, what: str, proc: subprocess.Popen[Any] | None) -> None:
        deadline = time.monotonic() + 60
        while not ok():
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"gave up waiting for {what}: exited\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    def agent_pid(self, name: str) -> int | None:
        """The agent process itself: the child of the node's keeper (`snapshotter agent`
        becomes its keeper and starts the agent under it), None while none runs."""
        for pid in children(self.agents[name].pid):  # also the orphaned rank sandboxes
            try:
                if b"snapshotter\0agent\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        return None

    def kill_agent(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the node's whole agent service (its keeper and the agent): SIGKILL is the
        node's agent lost for good, SIGSTOP one that never answers."""
        proc = self.agents[name]
        agent = self.agent_pid(name)
        proc.send_signal(sig)
        if agent is not None and sig != signal.SIGKILL:
            os.kill(agent, sig)
        if sig == signal.SIGKILL:
            proc.wait(10)
            if agent is not None:  # the keeper's death kills it (PR_SET_PDEATHSIG)
                self._wait(lambda: dead(agent), f"agent {name} to die with its keeper", None)

    def crash_agent(self, name: str) -> int:
        """kill -9 of the agent process alone (a crash): its keeper starts it again and the
        new agent re-adopts the node's ranks. Returns the killed pid."""
        agent = self.agent_pid(name)
        assert agent is not None, f"no agent runs under node {name}'s keeper"
        os.kill(agent, signal.SIGKILL)
        return agent

    def wait_restarted(self, name: str, old_pid: int) -> None:
        """Until node `name` runs a new agent process, registered with the coordinator."""
        node = self.cluster[name]
        seen: dict[str, str] = {}

        def back() -> bool:
            pid = self.agent_pid(name)
            if pid is None or pid == old_pid:
                return False
            agent = agent_client(
                Target(f"{node.ip}:{AGENT_PORT}", tls=self.tls(), server_name=name), peer="cli"
            )
            try:
                seen["incarnation"] = agent.stub.Ping(common_pb2.Empty(), timeout=3).incarnation
            except Exception:  # noqa: BLE001 - not up yet
                return False
            finally:
                agent.close()
            info = self.ping()
            return info is not None and info["incarnations"].get(name) == seen["incarnation"]

        self._wait(back, f"agent {name} to be restarted by its keeper", self.agents[name])

    def kill_coordinator(self) -> None:
        assert self.coord_proc is not None
        self.coord_proc.kill()
        self.coord_proc.wait(10)

    def logs(self) -> str:
        out = []
        for p in sorted(self.root.glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for proc in [*self.agents.values(), self.coord_proc]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.agents.values(), self.coord_proc]:
            if proc is None:
                continue
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for home in self.root.glob("home-*"):
            shutil.rmtree(home / "copies", ignore_errors=True)  # raw images, the largest files


class Op:
    """A CLI operation running in the background; `wait_phase` returns once it reached one."""

    def __init__(self, dep: Deployment, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "snapshotter", *args, "--json"],
            env=dep.cli.env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self.stderr: list[str] = []
        self._stdout: list[str] = []
        self._cv = threading.Condition()
        # Each pipe has one reader: a `communicate` beside this thread closed stderr under it.
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_out, daemon=True)]  # fmt: skip
        for t in self._readers:
            t.start()

    def _read_out(self) -> None:
        assert self.proc.stdout is not None
        self._stdout.extend(self.proc.stdout)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cv:
                self.stderr.append(line)
                try:
                    ev = json.loads(line)
                    if isinstance(ev, dict):
                        self.events.append(ev)
                except ValueError:
                    pass
                self._cv.notify_all()

    def wait_phase(self, phase: str, timeout: float = 120) -> None:
        def seen() -> bool:
            return any(e.get("phase") == phase for e in self.events)

        with self._cv:
            if not self._cv.wait_for(seen, timeout):
                raise AssertionError(f"phase {phase} not reached: {''.join(self.stderr)}")

    def result(self, timeout: float = 240) -> tuple[int, dict[str, Any]]:
        """Exit code and the last JSON line of stdout (the result or the error)."""
        self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=30)
        lines = "".join(self._stdout).strip().splitlines()
        return self.proc.returncode, json.loads(lines[-1]) if lines else {}


def metric_samples(text: str) -> dict[str, float]:
    """`name{labels}` -> value of each sample in a Prometheus text exposition."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        m = re.fullmatch(r"([a-z_]+(?:\{[^}]*\})?) (\S+)", line)
        if m:
            samples[m.group(1)] = float(m.group(2))
    return samples


def skip_without_nodes() -> None:
    """Skip unless this machine can run CRIU and make network-namespace nodes."""
    import pytest

    from tests.conftest import skip_without_criu

    skip_without_criu()
    why = netns_unavailable()
    if why:
        pytest.skip(why)


def rank_sandbox_pids(cluster: Cluster) -> list[int]:
    """Rank sandboxes (their snapinit) alive in any node, known to an agent or not."""
    out = []
    for node in cluster:
        for pid in _pids_in_netns(node.netns_path):
            try:
                argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            except OSError:
                continue  # gone meanwhile
            if argv0.endswith(b"snapinit"):
                out.append(pid)
    return out


def pids_in_node(cluster: Cluster, name: str) -> list[int]:
    """Every process in node `name`'s network namespace (its agent, its rank sandboxes)."""
    return _pids_in_netns(cluster[name].netns_path)


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def rank_pid(dep: Deployment, node: str, job: str, rank: int) -> int:
    """The host pid of rank `rank` of `job` (the hooked Python in its sandbox on `node`)."""
    for pid in pids_in_node(dep.cluster, node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # Not its sandbox's init, whose command line and environment are the rank's too.
        if (b"snapshotter.hook.bootstrap" in argv and f"RANK={rank}".encode() in env
                and f"SNAPSHOTTER_JOB_ID={job}".encode() in env
                and not argv.split(b"\0")[0].endswith(b"snapinit")):  # fmt: skip
            return pid
    raise LookupError(f"no process of rank {rank} of job {job} on node {node}")


def qdisc(node: Any, plane: int, spec: str | None) -> None:
    """Shape node's data link `plane` at both ends of its veth (egress each way)."""
    for argv in (["tc", "qdisc", "del" if spec is None else "replace", "dev",
                  node.link_host_ends[plane], "root"],
                 ["ip", "netns", "exec", node.netns, "tc", "qdisc",
                  "del" if spec is None else "replace", "dev", node.links[plane], "root"]):
        subprocess.run([*argv, *(spec.split() if spec else [])], check=spec is not None,
                       capture_output=True, timeout=30)  # fmt: skip
