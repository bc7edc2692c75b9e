"""A fake node agent for the hook's functional tests: real rendezvous server, real rank processes.

It starts `python -m snapshotter.hook.rdzv_server`, launches N ranks through
`python -m snapshotter.hook.bootstrap script.py` with a torchrun-like environment and the two
control pipes at fds 3 and 4, and speaks the control protocol to them. `close()` kills every
process it started, by pid.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter.hook import protocol
from snapshotter.hook.sockets import TcpSocket, tcp_sockets

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
PY = sys.executable


class AgentError(AssertionError):
    pass


def start_rdzv_server(host: str = "127.0.0.1") -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [PY, "-m", "snapshotter.hook.rdzv_server", "--host", host, "--port", "0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AgentError("rendezvous server exited before printing its address")
    return proc, int(json.loads(line)["port"])


def descendants(pid: int) -> list[int]:
    """pid and every process below it, from /proc (no psutil)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


@dataclass
class Rank:
    rank: int
    proc: subprocess.Popen[str]
    cmd_w: int
    replies: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    lines: list[str] = field(default_factory=list)
    line_event: threading.Condition = field(default_factory=threading.Condition)


class FakeAgent:
    def __init__(self, script: str, args: list[str], world_size: int = 2) -> None:
        self.extra_env: dict[str, str] = {}
        self.script = str(JOBS / script)
        self.args = args
        self.world_size = world_size
        self.rdzv_proc, self.port = start_rdzv_server()
        self.epoch = 0
        self.ranks: list[Rank] = []
        self._freeze_n = 0

    # ---- processes -------------------------------------------------------------------------

    def launch(self, hook: bool = True, env: dict[str, str] | None = None) -> None:
        self.extra_env = dict(env or {})
        for r in range(self.world_size):
            self.ranks.append(self._launch_one(r, hook))

    def _launch_one(self, rank: int, hook: bool) -> Rank:
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
        )
        env.update(self.extra_env)
        if hook:
            # The channel's fds keep their numbers in the rank (pass_fds); no preexec_fn: it
            # makes subprocess fork() this threaded test process and run its at-fork handlers
            # (grpc's among them) in the child before the exec.
            env.update(SNAPSHOTTER_CTL_IN=str(cmd_r), SNAPSHOTTER_CTL_OUT=str(rep_w))
            argv = [PY, "-X", "faulthandler", "-m", "snapshotter.hook.bootstrap", self.script,
                    *self.args]  # fmt: skip
        else:
            argv = [PY, "-X", "faulthandler", self.script, *self.args]

        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(cmd_r, rep_w),
        )
        os.close(cmd_r)
        os.close(rep_w)
        rk = Rank(rank, proc, cmd_w)
        threading.Thread(target=self._read_replies, args=(rk, rep_r), daemon=True).start()
        threading.Thread(target=self._read_stdout, args=(rk,), daemon=True).start()
        return rk

    @staticmethod
    def _read_replies(rk: Rank, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                rk.replies.put(json.loads(line))

    @staticmethod
    def _read_stdout(rk: Rank) -> None:
        assert rk.proc.stdout is not None
        for line in rk.proc.stdout:
            with rk.line_event:
                rk.lines.append(line.rstrip("\n"))
                rk.line_event.notify_all()

    def wait_line(self, rank: int, pattern: str, timeout: float = 60.0) -> str:
        rk = self.ranks[rank]
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with rk.line_event:
            while True:
                for line in rk.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(rk.lines)
                left = deadline - time.monotonic()
                if left <= 0 or rk.proc.poll() is not None and seen == len(rk.lines):
                    rk.line_event.release()  # the stacks come in through the reader thread
                    try:
                        self.dump_stacks()
                    finally:
                        rk.line_event.acquire()
                    raise AgentError(
                        f"rank {rank}: no line matching {pattern!r}; last output:\n"
                        + "\n".join(rk.lines[-60:])
                    )
                rk.line_event.wait(min(left, 0.5))

    def wait_exit(self, timeout: float = 120.0) -> None:
        """Every rank exits 0 within `timeout`; else an error with every rank's state and
        output (a rank that failed early leaves the others waiting in a collective)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [rk.proc.poll() for rk in self.ranks]
            if all(c == 0 for c in codes):
                return
            if any(c not in (None, 0) for c in codes):
                time.sleep(0.2)  # the rest of its output
                break
            time.sleep(0.1)
        self.dump_stacks()
        report = []
        for rk in self.ranks:
            rc = rk.proc.poll()
            state = "still running" if rc is None else f"exited {rc}"
            report.append(f"rank {rk.rank} {state}; last output:\n" + "\n".join(rk.lines[-60:]))
        if self.rdzv_proc.poll() is not None:
            report.append(f"the rendezvous server exited {self.rdzv_proc.returncode}")
        raise AgentError("\n".join(report))

    def dump_stacks(self) -> None:
        """Every thread's stack of every rank still running and of its children (DataLoader
        workers), into the output the errors show: SIGABRT makes faulthandler print them
        (the ranks run with -X faulthandler). For hangs no test could explain otherwise."""
        pids = []
        for rk in self.ranks:
            if rk.proc.poll() is None:
                try:
                    pids.extend(reversed(descendants(rk.proc.pid)))  # children first
                except OSError:
                    pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(2.0)

    def restart_rdzv(self) -> None:
        """Stop the rendezvous server and start a fresh one on a new port (as on a new node)."""
        old = self.port
        self.rdzv_proc.terminate()
        self.rdzv_proc.wait(10)
        self.rdzv_proc, self.port = start_rdzv_server()
        assert self.port != old

    def close(self) -> None:
        pids = []
        for rk in self.ranks:
            try:
                pids.extend(descendants(rk.proc.pid))
            except OSError:
                pass
            try:
                os.close(rk.cmd_w)
            except OSError:
                pass
        pids.append(self.rdzv_proc.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for rk in self.ranks:
            try:
                rk.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.rdzv_proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    # ---- protocol --------------------------------------------------------------------------

    def send(self, rank: int, msg: dict[str, Any]) -> None:
        os.write(self.ranks[rank].cmd_w, protocol.encode(msg))

    def expect(self, rank: int, op: str, timeout: float = 30.0) -> dict[str, Any]:
        try:
            msg = self.ranks[rank].replies.get(timeout=timeout)
        except queue.Empty as e:
            raise TimeoutError(f"rank {rank}: no {op!r} reply within {timeout}s") from e
        if msg.get("op") != op:
            raise AgentError(f"rank {rank}: expected {op!r}, got {msg}")
        return msg

    def all(self, msg: dict[str, Any], reply: str, timeout: float = 30.0) -> list[dict[str, Any]]:
        for r in range(self.world_size):
            self.send(r, msg)
        return [self.expect(r, reply, timeout) for r in range(self.world_size)]

    def new_freeze_id(self) -> str:
        self._freeze_n += 1
        return f"f{self._freeze_n}"

    def prepare_and_park(self, fid: str, extra: int = 1, timeout: float = 30.0) -> list[Any]:
        counts = self.all({"op": "prepare", "freeze": fid}, "counts")
        targets: dict[str, int] = {}
        for c in counts:
            for k, n in c["counts"].items():
                targets[k] = max(targets.get(k, 0), n + extra)
        return self.all({"op": "park", "freeze": fid, "targets": targets}, "parked", timeout)

    def freeze_and_thaw(self, check: Any = None) -> list[Any]:
        """prepare, park, suspend, (check), new store on a new port, resume. Returns parks."""
        fid = self.new_freeze_id()
        parks = self.prepare_and_park(fid)
        self.all({"op": "suspend", "freeze": fid}, "suspended")
        if check is not None:
            check()
        self.restart_rdzv()
        self.epoch += 1
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port)}
        self.all(
            protocol.resume(fid, str(self.epoch), "127.0.0.1", self.port, env), "resumed", 60
        )
        return parks

    def tcp_sockets_of(self, rank: int) -> dict[int, list[TcpSocket]]:
        """TCP sockets held by the rank and every process below it (DataLoader workers)."""
        out = {}
        for pid in descendants(self.ranks[rank].proc.pid):
            socks = tcp_sockets(pid)
            if socks:
                out[pid] = socks
        return out
