"""A rank suspended for a freeze whose agent dies ends itself (exit 75), also when the agent
took the only reader of the rank's stderr and replies with it.

That is the case of an agent killed while it restored the rank (tests/e2e: agent killed during
restore): the restored rank is suspended, nobody but that agent held the other ends of its
pipes, and no record of it existed yet for the next agent to end it. The rank here is a real
process running the hook's control reader (no torch: a rank without process groups parks at
once), driven over real pipes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.hook import protocol

REPO = Path(__file__).resolve().parents[2]
RANK = """
import sys, time
from snapshotter.hook import control
control.Hook(int(sys.argv[1]), int(sys.argv[2]), 0).start()
while True:
    time.sleep(0.2)
"""


class Rank:
    def __init__(self) -> None:
        cmd_r, self.cmd_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        self.err_r, err_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RANK, str(cmd_r), str(rep_w)],
            pass_fds=(cmd_r, rep_w), stdout=err_w, stderr=err_w, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        for fd in (cmd_r, rep_w, err_w):
            os.close(fd)
        self.replies = os.fdopen(self.rep_r, "rb", buffering=0)

    def ask(self, msg: dict, reply: str) -> None:
        os.write(self.cmd_w, protocol.encode(msg))
        line = b""
        while not line.endswith(b"\n"):
            chunk = self.replies.read(1)
            assert chunk, f"the rank closed its replies before {reply!r}: {self.output()}"
            line += chunk
        got = protocol.decode(line)
        assert got["op"] == reply, got

    def suspend(self) -> None:
        self.ask(protocol.prepare("f1"), "counts")
        self.ask(protocol.park("f1", {}), "parked")  # no process group: parked at once
        self.ask(protocol.suspend("f1"), "suspended")

    def output(self) -> str:
        os.set_blocking(self.err_r, False)
        try:
            return os.read(self.err_r, 65536).decode(errors="replace")
        except (BlockingIOError, OSError):
            return ""

    def exit_code(self, timeout: float = 30.0) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for fd in (self.cmd_w, self.err_r):
            try:
                os.close(fd)
            except OSError:
                pass
        self.replies.close()


@pytest.fixture()
def rank() -> Iterator[Rank]:
    r = Rank()
    yield r
    r.close()


@pytest.mark.parametrize("stderr_read", [True, False], ids=["keeper-reads-stderr", "nobody"])
def test_a_suspended_rank_whose_agent_died_exits(rank: Rank, stderr_read: bool) -> None:
    rank.suspend()
    # The agent dies: every end it held closes. A reply was on its way (a ping), so writing
    # it fails as well.
    rank.replies.close()
    if not stderr_read:
        os.close(rank.err_r)
    os.write(rank.cmd_w, protocol.encode(protocol.ping()))
    os.close(rank.cmd_w)
    code = rank.exit_code()
    assert code == 75, f"the rank is still running (exit {code}); a suspended rank must end"
    if stderr_read:
        assert "the node agent is gone while this rank was suspended" in rank.output()


def test_a_running_rank_whose_agent_died_trains_on(rank: Rank) -> None:
    """Not suspended: the rank goes on (the next agent ends it as an orphan, agent/orphans.py),
    and keeps its stderr for the job's own output."""
    rank.ask(protocol.ping(), "pong")
    os.close(rank.cmd_w)
    time.sleep(1.0)  # the reader has seen the end by now; nothing it does may end the rank
    assert rank.proc.poll() is None, rank.output()
