"""Faults across nodes, each on a real 2x2 gloo job (agents in network namespaces, real CRIU):
kill -9 of an agent during dump, upload and restore; of the coordinator at each phase; a rank
crashing during quiesce; a node that never answers; two coordinators at once.

Whatever happens, the freeze fails cleanly within its deadline (or completes), the job is
either running as before or cleanly stopped everywhere with a usable earlier snapshot, no
manifest exists for an incomplete snapshot, and what a failed freeze left is found by gc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from snapshotter.rpc.client import Target, coordinator_client
from snapshotter.v1 import coordinator_pb2 as cpb
from tests.support.cli import POLL_S, ROOT, TRAIN
from tests.support.disk import shed_bulk
from tests.support.multinode import (
    Deployment,
    Op,
    pids_in_node,
    rank_sandbox_pids,
    skip_without_nodes,
)
from tests.support.netns import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LEASE_S = 8.0  # agents give up on a freeze nobody drives after this long
# No DataLoader worker processes: these tests are about the control plane, and a rank without
# workers dumps a third of the bytes (workers are frozen and thawed in test_freeze_thaw).
FAST = ("--step-sleep", "0.05", "--workers", "0")
LONG = ("--steps", "100000", *FAST)  # runs until the test ends it
SHORT_STEPS = 300
SHORT = ("--steps", str(SHORT_STEPS), *FAST)
TERMINAL = {"FROZEN", "SUCCEEDED", "FAILED", "CANCELLED"}


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    skip_without_nodes()
    root = tmp_path_factory.mktemp("faults")
    with Cluster(["ctl", "a", "b", "c"]) as cluster:
        d = Deployment(cluster, root, f"file://{root / 'store'}", freeze_lease_s=LEASE_S)
        try:
            d.start(["a", "b", "c"])
            yield d
        finally:
            d.close()
            shed_bulk(root)


@pytest.fixture()
def healthy(dep: Deployment) -> Iterator[Deployment]:
    """Every test starts and ends with the coordinator and all three agents up, no job running
    and no orphaned chunks."""
    yield dep
    if dep.coord_proc is None or dep.coord_proc.poll() is not None:
        dep.start_coordinator()
    for name, proc in list(dep.agents.items()):
        if proc.poll() is not None:
            dep.start_agent(name)
        else:
            dep.kill_agent(name, signal.SIGCONT)
    dep.wait_agents(["a", "b", "c"])
    for j in dep.cli.json("jobs")["jobs"]:
        if j["state"] not in TERMINAL:
            dep.cli.run("cancel", j["job_id"], check=False)
    dep.cli.run("gc", "--delete", "--min-age", "0", check=False)


def _status(dep: Deployment, job: str) -> dict[str, Any]:
    st: dict[str, Any] = dep.cli.json("status", job)
    return st


def _wait_state(dep: Deployment, job: str, states: set[str], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(dep, job)
        if st["state"] in states:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} is {st['state']}, wanted {states}\n{dep.logs()}")
        time.sleep(POLL_S)


def _progresses(dep: Deployment, job: str, by: int = 5, timeout: float = 120) -> None:
    """The job trains on: every rank's step count grows."""
    before = [dep.cli.last_step(job, r) for r in range(4)]
    deadline = time.monotonic() + timeout
    while [dep.cli.last_step(job, r) for r in range(4)] < [b + by for b in before]:
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job} stopped training at {before}\n{dep.logs()}")
        time.sleep(0.5)


def _no_ranks_left(dep: Deployment) -> None:
    """No rank of any job is left in any node, orphans of a dead agent included."""
    deadline = time.monotonic() + 60
    while alive := rank_sandbox_pids(dep.cluster):
        if time.monotonic() > deadline:
            raise AssertionError(f"rank sandboxes still alive:\n{_where(dep, alive)}\n"
                                 f"{dep.logs()}")  # fmt: skip
        time.sleep(0.5)


def _where(dep: Deployment, pids: list[int]) -> str:
    """Each sandbox's node and state (its command line names the node it was dumped on, not
    the node it runs on after a restore)."""
    out = []
    for name in dep.cluster.nodes:
        for pid in set(pids) & set(pids_in_node(dep.cluster, name)):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                threads = len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                continue
            out.append(f"  node {name}: pid {pid}, state {state}, {threads} thread(s)")
    return "\n".join(out)


def _snapshots(dep: Deployment, job: str) -> list[str]:
    return [s["snapshot_id"] for s in dep.cli.json("list", "--job", job)["snapshots"]]


def _first_snapshot(dep: Deployment, tmp_path: Path, args: tuple[str, ...] = LONG) -> tuple:
    job = dep.cli.start_job(tmp_path / "out.json", *args, nodes="a,b")
    dep.cli.wait_step(job, 20)
    s1 = dep.cli.json("freeze", job)["snapshot_id"]
    return job, s1


def _thaw_trains(dep: Deployment, snapshot: str, nodes: str) -> None:
    """The earlier snapshot is usable: thawed onto healthy nodes, every rank trains on from it
    (test_agent_killed_during_freeze runs one to the end)."""
    job = dep.cli.json("thaw", snapshot, "--nodes", nodes, "--job-id", f"re-{time.time_ns()}")
    _progresses(dep, job["job_id"])
    assert _status(dep, job["job_id"])["nodes"] == nodes.split(",")
    dep.cli.run("cancel", job["job_id"])


def _thaw_finishes(dep: Deployment, snapshot: str, nodes: str, out: Path) -> None:
    """The earlier snapshot is usable: thawed onto healthy nodes, the job runs to the end."""
    job = dep.cli.json("thaw", snapshot, "--nodes", nodes, "--job-id", f"re-{time.time_ns()}")
    st = dep.cli.wait(job["job_id"])
    assert st["state"] == "SUCCEEDED", (st, dep.logs())
    assert json.loads(out.read_text())["steps"] == SHORT_STEPS


# ------------------------------------------------------------------------- agent killed
def test_a_crashed_agent_never_costs_the_job(healthy: Deployment, tmp_path: Path) -> None:
    """kill -9 of node 0's agent process while the job trains, then of node 1's during a
    freeze's dump and during one's upload: each time its keeper starts it again, the new
    agent re-adopts the ranks (node 0 serves the job's rendezvous on its old port), the job
    trains on, and a later freeze --stop and thaw run it to the end."""
    dep = healthy
    # Enough steps that the job still trains after three agent restarts (each ~7-8 s on a
    # loaded CI machine) and two failed freezes: with 400 it once ended first.
    steps = 800
    out = tmp_path / "out.json"
    job = dep.cli.start_job(out, "--steps", str(steps), *FAST, nodes="a,b")
    dep.cli.wait_step(job, 20)
    old = dep.crash_agent("a")
    dep.wait_restarted("a", old)
    assert _status(dep, job)["state"] == "RUNNING"
    _progresses(dep, job)

    # During the dump node b's ranks are suspended, their communicators torn down: the new
    # agent leaves them to the coordinator, which resumes the whole job (every node must
    # rebuild together). During the upload they train already.
    for phase in ("dump", "upload"):
        op = Op(dep, "freeze", job)
        op.wait_phase(phase)
        old = dep.crash_agent("b")
        code, res = op.result()
        assert code != 0 and "restarted meanwhile" in res["error"]["cause"], (phase, res)
        dep.wait_restarted("b", old)
        assert _status(dep, job)["state"] == "RUNNING", phase
        _progresses(dep, job)
    assert not _snapshots(dep, job)  # the failed freeze left no snapshot behind

    sid = dep.cli.json("freeze", job, "--stop")["snapshot_id"]
    assert dep.cli.json("thaw", sid)["job_id"] == job
    st = dep.cli.wait(job)
    assert st["state"] == "SUCCEEDED", (st, dep.logs())
    assert json.loads(out.read_text())["steps"] == steps


def test_agent_killed_during_freeze(healthy: Deployment, tmp_path: Path) -> None:
    """The whole agent service of a node (keeper and agent) killed mid-freeze: the node is
    lost, the job is stopped everywhere and an earlier snapshot thaws elsewhere."""
    dep = healthy
    phase = "dump"
    job, s1 = _first_snapshot(dep, tmp_path, SHORT)
    op = Op(dep, "freeze", job)
    op.wait_phase(phase)
    dep.kill_agent("b")
    code, res = op.result()
    assert code != 0 and "node(s) b do not answer" in res["error"]["cause"], res
    # Node b is gone: the job is stopped everywhere, no manifest. b's own ranks are ended
    # when its agent comes back (it kills what its previous incarnation left).
    _wait_state(dep, job, TERMINAL - {"SUCCEEDED"})
    assert _snapshots(dep, job) == [s1]
    dep.start_agent("b")
    _no_ranks_left(dep)
    # The earlier snapshot thaws onto a and c (b replaced) and the job finishes.
    _thaw_finishes(dep, s1, "a,c", tmp_path / "out.json")


def test_agent_killed_during_freeze_of_a_job_that_recovers(
    healthy: Deployment, tmp_path: Path
) -> None:
    """The same loss under --recover auto: the failed freeze stops the job's other ranks so
    none waits for the lost node, and the job is then recovered (its newest snapshot thawed
    with b replaced by the spare c), not reported CANCELLED and left there."""
    dep = healthy
    out = tmp_path / "out.json"
    p = dep.cli.run("run", "--detach", "--nnodes", "2", "--nproc-per-node", "2", "--nodes",
                    "a,b", "--recover", "auto", "--spares", "c", str(TRAIN), "--out", str(out),
                    *SHORT)  # fmt: skip
    job = p.stdout.strip().splitlines()[-1]
    dep.cli.wait_step(job, 20)
    s1 = dep.cli.json("freeze", job)["snapshot_id"]
    op = Op(dep, "freeze", job)
    op.wait_phase("dump")
    dep.kill_agent("b")
    code, res = op.result()
    assert code != 0 and "node(s) b do not answer" in res["error"]["cause"], res
    events = _until_event(dep, job, "recovered")
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["cause"] == "node_lost" and failure["nodes"] == ["b"], failure
    rec = next(e for e in events if e["kind"] == "recovered")
    assert rec["snapshot_id"] == s1 and rec["nodes"] == ["a", "c"], rec
    st = dep.cli.wait(job)
    assert st["state"] == "SUCCEEDED", (st, dep.logs())
    assert json.loads(out.read_text())["steps"] == SHORT_STEPS
    dep.start_agent("b")  # its agent ends the ranks the lost node still ran of the job
    _no_ranks_left(dep)


def _until_event(dep: Deployment, job: str, kind: str, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        events: list[dict] = dep.cli.json("events", job)["events"]
        if any(e["kind"] == kind for e in events):
            return events
        if time.monotonic() > deadline:
            raise AssertionError(f"no {kind} event for {job} within {timeout:.0f}s: {events}\n"
                                 f"{_status(dep, job)}\n{dep.logs()}")  # fmt: skip
        time.sleep(POLL_S)


def test_agent_killed_during_restore(healthy: Deployment, tmp_path: Path) -> None:
    dep = healthy
    job, s1 = _first_snapshot(dep, tmp_path, SHORT)
    dep.cli.run("cancel", job)
    op = Op(dep, "thaw", s1, "--nodes", "a,c", "--job-id", "torn")
    op.wait_phase("restore")
    dep.kill_agent("c")
    code, res = op.result()
    assert code != 0, res
    st = _status(dep, "torn") if "torn" in str(dep.cli.json("jobs")) else {"state": "absent"}
    assert st["state"] in TERMINAL | {"absent"}, st
    assert _snapshots(dep, job) == [s1]  # the snapshot is untouched
    dep.start_agent("c")
    dep.wait_agents(["c"])
    _no_ranks_left(dep)
    _thaw_trains(dep, s1, "a,c")


# ------------------------------------------------------------------------- coordinator killed
@pytest.mark.parametrize("phase", ["quiesce", "dump", "upload", "commit"])
def test_coordinator_killed_during_freeze(
    healthy: Deployment, tmp_path: Path, phase: str
) -> None:
    dep = healthy
    # --pause-at gives a long phase without collectives: the freeze waits in quiesce.
    extra = ("--pause-at", "60", "--pause-s", "20") if phase == "quiesce" else ()
    job = dep.cli.start_job(tmp_path / "out.json", *LONG, *extra, nodes="a,b")
    dep.cli.wait_step(job, 55 if phase == "quiesce" else 20)
    if phase == "quiesce":
        dep.cli.wait_step(job, 60)
    if phase == "upload":  # a policy set after launch outlives the coordinator
        dep.cli.json("policy", "set", job, "--snapshot-every", "1h", "--keep", "3")
    op = Op(dep, "freeze", job)
    op.wait_phase(phase)
    dep.kill_coordinator()
    code, _ = op.result()
    assert code != 0
    # The agents undo the freeze on their own once its lease runs out: the job trains on.
    dep.start_coordinator()
    dep.wait_agents(["a", "b", "c"])
    st = _wait_state(dep, job, {"RUNNING"})  # re-learned from the agents
    assert st["nodes"] == ["a", "b"] and len(st["ranks"]) == 4
    if phase == "upload":  # re-learned from the agents with the job's spec, and its events
        shown = dep.cli.json("policy", "show", job)  # from the store
        assert shown["interval_s"] == 3600 and shown["policy"]["keep"] == 3, shown
        kinds = [e["kind"] for e in dep.cli.json("events", job)["events"]]
        assert "policy" in kinds, kinds
    _progresses(dep, job, timeout=LEASE_S + 120)
    listed = _snapshots(dep, job)
    if phase != "commit":
        assert listed == [], "no manifest may exist for an incomplete snapshot"
    # Whatever the dead coordinator's freeze left is an orphan (the agents delete what they
    # were writing when the stream broke); gc removes the rest for good.
    dep.cli.json("gc", "--delete", "--min-age", "0")
    assert dep.cli.json("gc", "--min-age", "0")["orphans"] == []
    # The new coordinator can freeze the job.
    assert dep.cli.json("freeze", job)["stopped"] is False
    dep.cli.run("cancel", job)


def test_a_replaced_coordinator_is_fenced(healthy: Deployment, tmp_path: Path) -> None:
    dep = healthy
    job = dep.cli.start_job(tmp_path / "out.json", *LONG, nodes="a,b")
    dep.cli.wait_step(job, 10)
    # A second coordinator (a restart elsewhere) takes the next epoch and talks to the nodes.
    log = open(dep.root / "coordinator2.log", "ab")  # noqa: SIM115
    second = f"{dep.ctl.ip}:7072"
    proc = dep.ctl.popen(
        [sys.executable, "-m", "snapshotter", "coordinator", "--listen", second,
         "--store", dep.store_url, "--tls-dir", str(dep.tls_dir)],
        env=dep._env(dep.root / "coord2-home"), stdout=log, stderr=log, cwd=ROOT,
    )  # fmt: skip
    log.close()
    try:
        deadline = time.monotonic() + 60
        while dep.ping(second) is None:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.3)
        for n in ("a", "b"):
            # What each node's agent would send, with that node's certificate.
            node = dep.cluster[n]
            c2 = coordinator_client(Target(second, tls=dep.tls(f"nodes/{n}")), peer="agent")
            req = cpb.RegisterAgentRequest(name=n, address=f"{node.ip}:7071", host=node.ip)
            c2.stub.RegisterAgent(req, timeout=10)
            c2.close()
        new = dict(dep.cli.env, SNAPSHOTTER_COORDINATOR=second)
        p = subprocess.run([sys.executable, "-m", "snapshotter", "freeze", job, "--json"],
                           env=new, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        # The old coordinator is refused by the nodes from now on, and says why.
        old = dep.cli.run("freeze", job, "--json", check=False)
        assert old.returncode == 12, old.stdout + old.stderr
        assert json.loads(old.stdout.strip().splitlines()[-1])["error"]["code"] == "fenced"
        _progresses(dep, job)
    finally:
        proc.terminate()
        proc.wait(15)
        # The nodes now follow the second coordinator's epoch; a restart takes a newer one.
        dep.kill_coordinator()
        dep.start_coordinator()
        dep.wait_agents(["a", "b", "c"])
        dep.cli.run("cancel", job, check=False)


# ------------------------------------------------------------------------- ranks and nodes
def test_rank_crash_during_quiesce(healthy: Deployment, tmp_path: Path) -> None:
    dep = healthy
    job = dep.cli.start_job(tmp_path / "out.json", *SHORT, "--pause-at", "60", "--pause-s", "15",
                            nodes="a,b")  # fmt: skip
    dep.cli.wait_step(job, 20)
    s1 = dep.cli.json("freeze", job)["snapshot_id"]
    dep.cli.wait_step(job, 60)  # now in the long phase without collectives
    op = Op(dep, "freeze", job)
    op.wait_phase("quiesce")
    victim = next(r for r in _status(dep, job)["ranks"] if r["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    code, res = op.result(timeout=180)
    assert code != 0, res
    _wait_state(dep, job, {"FAILED", "CANCELLED"})
    _no_ranks_left(dep)
    assert _snapshots(dep, job) == [s1]
    _thaw_trains(dep, s1, "a,c")


def test_node_that_never_answers(healthy: Deployment, tmp_path: Path) -> None:
    dep = healthy
    # Slower steps: the job must still be training when the freeze gives up on node b.
    slow = ("--steps", "500", "--step-sleep", "0.12", "--workers", "0")
    job, s1 = _first_snapshot(dep, tmp_path, slow)
    dep.kill_agent("b", signal.SIGSTOP)
    t0 = time.monotonic()
    code, res = Op(dep, "freeze", job).result(timeout=240)
    took = time.monotonic() - t0
    assert code != 0 and "node(s) b do not answer" in res["error"]["cause"], res
    assert took < 120, f"the freeze must fail within its deadline, took {took:.0f}s"
    dep.kill_agent("b", signal.SIGCONT)
    # The job was stopped on the nodes that answer; b's ranks lose their peers and end too.
    st = _wait_state(dep, job, TERMINAL, timeout=180)
    assert st["state"] != "SUCCEEDED", st
    _no_ranks_left(dep)
    assert _snapshots(dep, job) == [s1]
    _thaw_trains(dep, s1, "a,c")


# ------------------------------------------------------------------------- migration
def _ranks_in(dep: Deployment, node: str) -> set[int]:
    return set(rank_sandbox_pids(dep.cluster)) & set(pids_in_node(dep.cluster, node))


@pytest.mark.parametrize("what", [("--node", "b"), ("--rank", "3")], ids=["node", "rank"])
def test_target_lost_mid_migration_leaves_the_job_where_it_was(
    healthy: Deployment, tmp_path: Path, what: tuple[str, str]
) -> None:
    """`migrate --node b --to c` (or `--rank 3`) with c's whole agent service killed during
    the transfer: the migration fails naming c, ranks 2 and 3 go on on b (node a's never
    stopped being the same processes); with c back, the same migration completes and the
    job ends."""
    dep = healthy
    out = tmp_path / "out.json"
    steps = 1200
    job = dep.cli.start_job(out, "--steps", str(steps), *FAST, nodes="a,b")
    dep.cli.wait_step(job, 20)
    on_a = _ranks_in(dep, "a")
    op = Op(dep, "migrate", job, *what, "--to", "c")
    op.wait_phase("transfer")
    dep.kill_agent("c")
    code, res = op.result()
    assert code == 16 and res["error"]["code"] == "migration_failed", res
    assert "node c" in res["error"]["cause"], res
    st = _status(dep, job)
    assert st["state"] == "RUNNING" and st["nodes"] == ["a", "b"], st
    _progresses(dep, job)
    assert _ranks_in(dep, "a") == on_a and len(_ranks_in(dep, "b")) == 2

    dep.start_agent("c")
    dep.wait_agents(["c"])
    moved = dep.cli.json("migrate", job, *what, "--to", "c")
    assert moved["nodes"] == (["a", "c"] if what[0] == "--node" else ["a", "b", "c"]), moved
    st = dep.cli.wait(job)
    assert st["state"] == "SUCCEEDED", (st, dep.logs())
    assert json.loads(out.read_text())["steps"] == steps
    for rank in (2, 3):
        seen = dep.cli.steps(job, rank=rank)
        assert seen == list(range(1, steps + 1)), seen[-20:]


def test_source_agent_crash_mid_migration_leaves_the_job_where_it_was(
    healthy: Deployment, tmp_path: Path
) -> None:
    """kill -9 of the source's agent process during the transfer: its keeper starts it again,
    the new agent re-adopts ranks 2 and 3 and the coordinator resumes them in place; nothing
    of the job is left on c."""
    dep = healthy
    job = dep.cli.start_job(tmp_path / "out.json", *LONG, nodes="a,b")
    dep.cli.wait_step(job, 20)
    op = Op(dep, "migrate", job, "--node", "b", "--to", "c")
    op.wait_phase("transfer")
    old = dep.crash_agent("b")
    code, res = op.result()
    assert code == 16 and res["error"]["code"] == "migration_failed", res
    dep.wait_restarted("b", old)
    st = _wait_state(dep, job, {"RUNNING"})
    assert st["nodes"] == ["a", "b"], st
    _progresses(dep, job)
    assert not _ranks_in(dep, "c")
    assert not list((dep.home("c") / "work").glob("thaw-*")), "received images were left on c"
    dep.cli.run("cancel", job)
