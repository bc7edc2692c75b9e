"""Freeze/thaw of real 2-rank gloo jobs through the in-rank hook, driven by a fake agent.

No CRIU here: a freeze is prepare -> park -> suspend (no TCP socket left in the rank's process
tree) -> a new store server on a new port -> resume. The job's final state must be bit-identical
to an uninterrupted run without the hook.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.support.hookagent import FakeAgent

pytestmark = pytest.mark.timeout(240)

DDP_STEPS = "300"
SUB_STEPS = "1000"


def run_job(tmp: Path, script: str, steps: str, hook: bool, drive=None, env=None) -> str:  # type: ignore[no-untyped-def]
    out = tmp / f"{script}.{os.urandom(4).hex()}.sha"
    agent = FakeAgent(script, [str(out), steps])
    try:
        agent.launch(hook=hook, env=env)
        if drive is not None:
            drive(agent)
        agent.wait_exit(180)
        return out.read_text()
    finally:
        agent.close()


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    return run_job(tmp_path_factory.mktemp("ref"), "ddp_train.py", DDP_STEPS, hook=False)


def assert_no_tcp(agent: FakeAgent) -> None:
    for r in range(agent.world_size):
        left = agent.tcp_sockets_of(r)
        assert left == {}, f"rank {r} process tree still holds TCP sockets: {left}"


def test_hook_alone_changes_nothing(tmp_path: Path, ddp_reference: str) -> None:
    assert run_job(tmp_path, "ddp_train.py", DDP_STEPS, hook=True) == ddp_reference


@pytest.mark.parametrize("path", ["native", "python"])
def test_ddp_survives_two_freezes_bit_identical(
    tmp_path: Path, ddp_reference: str, path: str
) -> None:
    """On the native path (the default, built by the install) and on the Python fallback."""
    parks = []

    def drive(agent: FakeAgent) -> None:
        agent.send(0, {"op": "ping"})
        pong = agent.expect(0, "pong")
        assert pong["rank"] == 0 and pong["pid"] == agent.ranks[0].proc.pid
        assert pong["native"] is (path == "native")
        for step in (40, 150):
            agent.wait_line(0, rf"^step {step} ")
            parks.append(agent.freeze_and_thaw(check=lambda: assert_no_tcp(agent)))

    env = {"SNAPSHOTTER_NATIVE_HOOK": "0"} if path == "python" else {}
    got = run_job(tmp_path, "ddp_train.py", DDP_STEPS, hook=True, drive=drive, env=env)
    assert got == ddp_reference
    for freeze in parks:
        # Every rank stops before the same DDP allreduce on the default group.
        assert len({(p["at"]["group"], p["at"]["seq"]) for p in freeze}) == 1


def test_abort_after_park_leaves_job_running(tmp_path: Path, ddp_reference: str) -> None:
    def drive(agent: FakeAgent) -> None:
        agent.wait_line(0, r"^step 60 ")
        fid = agent.new_freeze_id()
        agent.prepare_and_park(fid)
        agent.all({"op": "abort", "freeze": fid}, "aborted")
        agent.send(0, {"op": "ping"})
        agent.expect(0, "pong")

    assert run_job(tmp_path, "ddp_train.py", DDP_STEPS, hook=True, drive=drive) == ddp_reference


def drain_until(agent: FakeAgent, rank: int, op: str, timeout: float = 30.0) -> None:
    """Skip late `parked` replies until `op` arrives."""
    while True:
        msg = agent.ranks[rank].replies.get(timeout=timeout)
        if msg["op"] == op:
            return
        assert msg["op"] == "parked", msg


def test_rank_that_never_parks_fails_the_freeze_not_the_job(
    tmp_path: Path, ddp_reference: str
) -> None:
    def drive(agent: FakeAgent) -> None:
        agent.wait_line(0, r"^step 60 ")
        fid = agent.new_freeze_id()
        counts = agent.all({"op": "prepare", "freeze": fid}, "counts")
        targets = {k: max(c["counts"][k] for c in counts) + 1 for k in counts[0]["counts"]}
        stopped = agent.ranks[1].proc.pid
        os.kill(stopped, signal.SIGSTOP)
        try:
            for r in range(2):
                agent.send(r, {"op": "park", "freeze": fid, "targets": targets})
            with pytest.raises(TimeoutError):
                agent.expect(1, "parked", timeout=3)
            # The deadline passed: the freeze fails and every rank is told to go on.
            for r in range(2):
                agent.send(r, {"op": "abort", "freeze": fid})
            drain_until(agent, 0, "aborted")
        finally:
            os.kill(stopped, signal.SIGCONT)
        drain_until(agent, 1, "aborted")

    assert run_job(tmp_path, "ddp_train.py", DDP_STEPS, hook=True, drive=drive) == ddp_reference


def test_subgroups_and_device_mesh_survive_freeze(tmp_path: Path) -> None:
    reference = run_job(tmp_path, "subgroups.py", SUB_STEPS, hook=False)

    def drive(agent: FakeAgent) -> None:
        agent.wait_line(0, r"^step 100 ")
        fid = agent.new_freeze_id()
        counts = agent.all({"op": "prepare", "freeze": fid}, "counts")
        # Keys are torch's group names: the same on every member, absent on non-members
        # (rank 1 is not in new_group([0]) = "1"; DeviceMesh's size-1 "dp" groups differ).
        assert "1" in counts[0]["counts"] and "1" not in counts[1]["counts"]
        assert {"0", "2"} <= set(counts[0]["counts"]) & set(counts[1]["counts"])
        agent.all({"op": "abort", "freeze": fid}, "aborted")

        agent.wait_line(0, r"^step 150 ")
        agent.freeze_and_thaw(check=lambda: assert_no_tcp(agent))

        agent.wait_line(0, r"^step 250 ")
        # A target nobody reaches: the freeze times out and is aborted; the job goes on.
        fid = agent.new_freeze_id()
        with pytest.raises(TimeoutError):
            agent.prepare_and_park(fid, extra=10_000, timeout=1)
        for r in range(2):
            agent.send(r, {"op": "abort", "freeze": fid})
        for r in range(2):
            drain_until(agent, r, "aborted")

    assert run_job(tmp_path, "subgroups.py", SUB_STEPS, hook=True, drive=drive) == reference


def test_protocol_errors_are_replies(tmp_path: Path) -> None:
    def drive(agent: FakeAgent) -> None:
        agent.wait_line(0, r"^step 5 ")
        agent.send(0, {"op": "suspend", "freeze": "x"})
        err = agent.expect(0, "error")
        assert err["freeze"] == "x" and "not parked" in err["message"]
        agent.send(0, {"op": "bogus"})
        assert "unknown op" in agent.expect(0, "error")["message"]
        agent.send(0, {"op": "abort", "freeze": "x"})  # idempotent when nothing is armed
        agent.expect(0, "aborted")

    run_job(tmp_path, "subgroups.py", "100", hook=True, drive=drive)
