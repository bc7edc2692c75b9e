"""The keeper (snapshotter/keeper.py) with real processes: it holds pipes handed over with
SCM_RIGHTS and pumps output into a log while no agent runs, restarts the agent it started when
that dies, reaps the agent's orphans and keeps their exit status, and gives the pipes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.agent.keeping import KeeperClient
from tests.support.procs import children, dead

# The stand-in agent: starts a "rank" (a child that prints, then sleeps) and reports its pid.
AGENT = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen(['sh', '-c', 'sleep 3; exit 7'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _until(cond, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture()
def keeper(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], KeeperClient]]:
    sock = tmp_path / "keeper.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter.keeper", "--socket", str(sock), "--",
         sys.executable, "-c", AGENT],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _until(sock.exists)
        yield proc, KeeperClient(str(sock))
    finally:
        for pid in children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(10)


def test_pipes_outlive_the_agent_and_come_back(
    keeper: tuple[subprocess.Popen[str], KeeperClient], tmp_path: Path
) -> None:
    proc, client = keeper
    assert proc.stdout is not None
    rank = int(proc.stdout.readline())
    (agent,) = [c for c in children(proc.pid) if c != rank] or children(proc.pid)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    in_r, in_w = os.pipe()
    ctl_r, ctl_w = os.pipe()
    log = tmp_path / "rank.log"
    client.hold("job/0/1", rank, {"job": {"job_id": "job"}}, log, [out_r, err_r, in_w, ctl_r])
    for fd in (out_r, err_r, in_w, ctl_r):
        os.close(fd)  # the keeper holds its own copies now

    os.kill(agent, signal.SIGKILL)  # the agent dies; the keeper starts it again
    _until(lambda: [c for c in children(proc.pid) if c not in (agent, rank)])
    os.write(out_w, b"step 1\n")  # the rank's output still flows into its log
    os.write(err_w, b"warning\n")
    _until(lambda: log.exists() and b"step 1\nwarning\n" in log.read_bytes()
           or b"warning\nstep 1\n" in log.read_bytes())

    # The orphaned rank was reparented to the keeper, which reaped it and kept its status.
    (held,) = client.held()
    assert held["key"] == "job/0/1" and held["meta"] == {"job": {"job_id": "job"}}
    # A policy set after launch: the next agent re-adopts the job with the new spec.
    assert client.respec("job", {"job_id": "job", "policy": {"keep": 3}}) == 1
    assert client.respec("other", {"job_id": "other"}) == 0
    (held,) = client.held()
    assert held["meta"] == {"job": {"job_id": "job", "policy": {"keep": 3}}}
    # Its node 0 migrated: the next agent resumes the ranks against the moved server.
    assert client.rerdzv("job", "10.0.0.9", 4242) == 1
    assert client.rerdzv("other", "10.0.0.9", 4242) == 0
    (held,) = client.held()
    assert held["meta"]["remote_rdzv"] == ["10.0.0.9", 4242]
    assert held["meta"]["rdzv_port"] is None
    _until(lambda: client.exit_code(rank) is not None, timeout=30)
    assert client.exit_code(rank) == 7

    # The control channel comes back: what goes in at the agent's end reaches the rank's.
    got_in, got_out = client.fetch("job/0/1")
    os.write(got_in, b"ping\n")
    assert os.read(in_r, 100) == b"ping\n"
    os.write(ctl_w, b"pong\n")
    assert os.read(got_out, 100) == b"pong\n"
    for fd in (got_in, got_out):
        os.close(fd)

    client.release("job/0/1")
    assert client.held() == []
    for fd in (out_w, err_w, in_r, ctl_w):
        os.close(fd)

    proc.send_signal(signal.SIGTERM)  # stopping the keeper stops its agent, cleanly
    assert proc.wait(20) == 0


def test_an_agent_that_fails_at_once_is_not_restarted(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotter.keeper", "--socket", str(tmp_path / "k.sock"), "--",
         sys.executable, "-c", "raise SystemExit(3)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    assert "not restarting it" in proc.stderr
    assert not (tmp_path / "k.sock").exists()


def _agent_of(proc: subprocess.Popen[str], rank: int) -> int:
    return _until(lambda: [c for c in children(proc.pid) if c != rank])[0]


def test_sighup_restarts_the_agent_and_a_killed_keeper_takes_it_along(
    keeper: tuple[subprocess.Popen[str], KeeperClient],
) -> None:
    proc, client = keeper
    assert proc.stdout is not None
    rank = int(proc.stdout.readline())
    agent = _agent_of(proc, rank)

    proc.send_signal(signal.SIGHUP)  # an upgrade: a new agent at once, the keeper stays
    new = _until(lambda: [c for c in children(proc.pid) if c not in (agent, rank)])[0]
    assert proc.poll() is None and not Path(f"/proc/{agent}").exists()
    assert client.held() == []  # it still answers

    proc.kill()  # the whole service lost: its agent must not run on without a keeper
    proc.wait(10)
    _until(lambda: dead(new))
