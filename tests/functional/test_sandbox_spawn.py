"""Functional tests of the rank sandbox (snapinit + spawn): real processes, no CRIU.

Also home of the test rank program and the helpers test_sandbox_criu.py reuses.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.errors import SandboxError
from snapshotter.sandbox.spawn import Sandbox, become_subreaper, spawn

# A stand-in for a training rank: counts, one line per tick on stdout and stderr; echoes
# control lines from fd 3 to fd 4; SIGTERM runs a handler. Options:
#   --exit N   exit N at once            --child   fork a worker fed through a pipe
#   --tcp PORT hold a TCP connection     --shm MB  keep an unlinked /dev/shm file mapped
#   --tcp-echo (with --tcp) send back what comes in on it
RANK_SRC = r"""
import mmap, os, signal, socket, sys, threading, time

args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1] if name in args else None
if opt("--exit") is not None:
    sys.exit(int(opt("--exit")))

def on_term(signum, frame):
    say(1, "got SIGTERM")
    os._exit(42)

signal.signal(signal.SIGTERM, on_term)
say = lambda fd, text: os.write(fd, f"{text}\n".encode())  # one write: threads interleave

def echo():
    while True:
        data = os.read(3, 4096)
        if not data:
            return
        os.write(4, data)

threading.Thread(target=echo, daemon=True).start()

keep = []
if opt("--tcp") is not None:
    keep.append(socket.create_connection(("127.0.0.1", int(opt("--tcp")))))
    if "--tcp-echo" in args:  # what comes in goes back out, as a client's request and reply
        def tcp_echo(s=keep[-1]):
            while data := s.recv(4096):
                s.sendall(data)
        threading.Thread(target=tcp_echo, daemon=True).start()
if opt("--shm") is not None:
    path = f"/dev/shm/snapshotter-test-{os.getpid()}-{time.time_ns()}"
    size = int(opt("--shm")) << 20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.unlink(path)  # what DataLoader workers do with their shared-memory tensors
    shm = mmap.mmap(fd, size)
    shm[:] = b"\xa5" * size  # real pages: CRIU's ghost limit counts allocated blocks
    shm[:8] = b"shm-ok!\n"
    keep.append(shm)
if "--child" in args:
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        k = 0
        while True:
            k += 1
            os.write(w, f"{k}\n".encode())
            time.sleep(0.05)
    os.close(w)

    def relay():
        with os.fdopen(r, "rb") as f:
            for line in f:
                say(1, f"child {int(line)}")

    threading.Thread(target=relay, daemon=True).start()

n = 0
while True:
    n += 1
    extra = f" {keep[-1][:7].decode()}" if opt("--shm") is not None else ""
    say(1, f"tick {n}{extra}")
    say(2, f"etick {n}")
    time.sleep(0.05)
"""


class Lines:
    """Reads lines from a pipe with deadlines."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.lines: list[str] = []
        self.eof = False

    def _fill(self, deadline: float) -> bool:
        left = max(0.0, deadline - time.monotonic())
        if self.eof or not select.select([self.fd], [], [], left)[0]:
            return False
        data = os.read(self.fd, 65536)
        if not data:
            self.eof = True
            return False
        self.buf += data
        *done, self.buf = self.buf.split(b"\n")
        self.lines += [d.decode() for d in done]
        return True

    def wait_for(self, pattern: str, timeout: float = 10.0, start: int = 0) -> re.Match[str]:
        """First line (from index `start`) matching `pattern`; waits for it."""
        deadline = time.monotonic() + timeout
        seen = start
        while True:
            for line in self.lines[seen:]:
                m = re.search(pattern, line)
                if m:
                    return m
            seen = max(seen, len(self.lines))
            if not self._fill(deadline):
                why = "EOF" if self.eof else "timeout"
                raise TimeoutError(f"{why}: no line matching {pattern!r}; last: {self.lines[-5:]}")

    def drain(self, quiet: float = 0.0) -> list[str]:
        """Everything that arrives until the pipe has been idle for `quiet` seconds."""
        while self._fill(time.monotonic() + quiet):
            pass
        return self.lines


def last_int(lines: list[str], prefix: str) -> int:
    values = [int(ln.split()[1]) for ln in lines if ln.startswith(prefix + " ")]
    assert values, f"no {prefix!r} lines in {lines[-5:]}"
    return values[-1]


def ctl_roundtrip(sb: Sandbox, text: str, timeout: float = 10.0) -> str:
    os.write(sb.io.ctl_in, text.encode() + b"\n")
    return Lines(sb.io.ctl_out).wait_for(re.escape(text), timeout).group(0)


@pytest.fixture(scope="module")
def subreaper() -> None:
    become_subreaper()


@pytest.fixture
def rank_py(tmp_path: Path) -> Path:
    path = tmp_path / "rank.py"
    path.write_text(RANK_SRC)
    return path


class Sandboxes:
    """Starts sandboxes and guarantees that every one is killed and reaped."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.all: list[Sandbox] = []

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER_CTL")}
        return env | {"SNAPSHOTTER_CTL_IN": "3", "SNAPSHOTTER_CTL_OUT": "4"}

    def spawn(self, rank_py: Path, *args: str, cwd: Path | None = None, **kw: object) -> Sandbox:
        init_cwd = self.root / f"init-{uuid.uuid4().hex[:8]}"
        sb = spawn(
            [sys.executable, "-u", str(rank_py), *args],
            self.env(),
            cwd or self.root,
            init_cwd=init_cwd,
            **kw,  # type: ignore[arg-type]
        )
        self.all.append(sb)
        return sb

    def add(self, sb: Sandbox) -> Sandbox:
        self.all.append(sb)
        return sb

    def cleanup(self) -> None:
        for sb in self.all:
            sb.kill()
            sb.wait(10)
            sb.close()


@pytest.fixture
def sandboxes(tmp_path: Path, subreaper: None) -> Iterator[Sandboxes]:
    sbs = Sandboxes(tmp_path)
    try:
        yield sbs
    finally:
        sbs.cleanup()


@pytest.mark.timeout(60)
def test_output_and_control_pipes(sandboxes: Sandboxes, rank_py: Path) -> None:
    sb = sandboxes.spawn(rank_py)
    out, err = Lines(sb.io.stdout), Lines(sb.io.stderr)
    out.wait_for(r"^tick 3$")
    err.wait_for(r"^etick 3$")
    assert ctl_roundtrip(sb, "hello rank") == "hello rank"
    # The init is pid 1 of its own namespace and our child.
    status = Path(f"/proc/{sb.pid}/status").read_text()
    assert re.search(r"^NSpid:\s+\d+\s+1$", status, re.M), status
    assert re.search(rf"^PPid:\s+{os.getpid()}$", status, re.M), status
    assert sb.poll() is None


@pytest.mark.timeout(60)
def test_init_cwd_is_private_and_rank_keeps_cwd(sandboxes: Sandboxes, rank_py: Path) -> None:
    work = sandboxes.root / "work"
    work.mkdir()
    sb = sandboxes.spawn(rank_py, cwd=work)
    Lines(sb.io.stdout).wait_for(r"^tick 1$")
    init_cwd = Path(os.readlink(f"/proc/{sb.pid}/cwd"))
    assert init_cwd.parent == sandboxes.root and init_cwd.name.startswith("init-")
    children = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    assert len(children) == 1
    assert os.readlink(f"/proc/{children[0]}/cwd") == str(work)
    # Nothing but 0-4 in the rank (Python may hold a few fds of its own above 4: none here).
    fds = sorted(int(fd) for fd in os.listdir(f"/proc/{children[0]}/fd"))
    assert fds[:5] == [0, 1, 2, 3, 4]
    assert os.readlink(f"/proc/{children[0]}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{children[0]}/fd/1") == f"pipe:[{sb.io.inodes['stdout']}]"
    assert os.readlink(f"/proc/{children[0]}/fd/3") == f"pipe:[{sb.io.inodes['ctl_in']}]"
    assert sorted(int(fd) for fd in os.listdir(f"/proc/{sb.pid}/fd")) == [0, 1, 2]


@pytest.mark.timeout(60)
def test_exit_status_propagates(sandboxes: Sandboxes, rank_py: Path) -> None:
    sb = sandboxes.spawn(rank_py, "--exit", "3")
    assert sb.wait(20) == 3
    assert sb.returncode == 3
    out = Lines(sb.io.stdout)
    assert out.drain(5) == [] and out.eof  # nothing left in the sandbox holds the pipe


@pytest.mark.timeout(60)
def test_sigterm_is_forwarded_to_the_rank(sandboxes: Sandboxes, rank_py: Path) -> None:
    sb = sandboxes.spawn(rank_py)
    out = Lines(sb.io.stdout)
    out.wait_for(r"^tick 2$")
    sb.send_signal(signal.SIGTERM)
    out.wait_for(r"^got SIGTERM$")
    assert sb.wait(20) == 42


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_gives_128_plus_signal(sandboxes: Sandboxes, rank_py: Path) -> None:
    sb = sandboxes.spawn(rank_py)
    Lines(sb.io.stdout).wait_for(r"^tick 1$")
    (rank,) = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
    os.kill(int(rank), signal.SIGKILL)
    assert sb.wait(20) == 128 + signal.SIGKILL


@pytest.mark.timeout(60)
def test_kill_takes_the_whole_namespace(sandboxes: Sandboxes, rank_py: Path) -> None:
    sb = sandboxes.spawn(rank_py, "--child")
    Lines(sb.io.stdout).wait_for(r"^child 2$")
    sb.kill()
    assert sb.wait(20) == -signal.SIGKILL
    out = Lines(sb.io.stdout)
    out.drain(5)
    assert out.eof  # the worker died with the init: nothing holds the pipe


@pytest.mark.timeout(60)
def test_bad_argv_is_exit_127(sandboxes: Sandboxes) -> None:
    sb = sandboxes.add(
        spawn(["/nonexistent/rank"], {}, sandboxes.root, init_cwd=sandboxes.root / "i")
    )
    assert sb.wait(20) == 127
    assert "nonexistent" in Lines(sb.io.stderr).drain()[0]


@pytest.mark.timeout(60)
def test_missing_netns_is_a_sandbox_error(sandboxes: Sandboxes, rank_py: Path) -> None:
    with pytest.raises(SandboxError, match="not found"):
        sandboxes.spawn(rank_py, netns=f"snapshotter-missing-{uuid.uuid4().hex[:6]}")


@pytest.mark.timeout(60)
def test_netns_is_entered_alone(sandboxes: Sandboxes, rank_py: Path) -> None:
    name = f"snapt-{uuid.uuid4().hex[:8]}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        sb = sandboxes.spawn(rank_py, netns=name)
        Lines(sb.io.stdout).wait_for(r"^tick 1$")
        (rank,) = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
        ns = os.stat(f"/run/netns/{name}")
        for pid in (str(sb.pid), rank):
            assert os.stat(f"/proc/{pid}/ns/net").st_ino == ns.st_ino
            # Only the network namespace: same mount namespace as ours.
            assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    finally:
        sandboxes.cleanup()
        sandboxes.all.clear()
        subprocess.run(["ip", "netns", "delete", name], check=False)


# Prints, every 50 ms, the pid it has and the pid /proc/self names: equal only when /proc is
# the rank's own PID namespace's (the CUDA driver needs that: cuInit fails with 304 otherwise).
PROC_SRC = r"""
import os, time
while True:
    os.write(1, f"pid {os.getpid()} procself {os.readlink('/proc/self')}\n".encode())
    time.sleep(0.05)
"""


@pytest.mark.timeout(60)
def test_private_tmp_sandbox_has_its_own_proc(sandboxes: Sandboxes, tmp_path: Path) -> None:
    from snapshotter.sandbox.spawn import PRIVATE_TMP

    prog = tmp_path / "proc.py"
    prog.write_text(PROC_SRC)
    sb = sandboxes.spawn(prog, private_tmp=PRIVATE_TMP)
    m = Lines(sb.io.stdout).wait_for(r"^pid (\d+) procself (\d+)$")
    assert m.group(1) == m.group(2) == "2"  # the rank, right after its init (pid 1)
    assert os.readlink("/proc/self") == str(os.getpid())  # the host's /proc is untouched


@pytest.mark.timeout(60)
@pytest.mark.parametrize("private", [False, True], ids=["host-mounts", "private-tmp"])
def test_no_descriptor_of_the_caller_reaches_the_sandbox(
    sandboxes: Sandboxes, rank_py: Path, private: bool
) -> None:
    """With the caller's fd numbers far above 64 (a long-running agent's), spawn returns at
    once and neither the init nor the rank holds anything but 0-4: no pid-pipe end to keep
    spawn from seeing EOF, no agent pipe, no inheritable fd the caller happened to have."""
    from snapshotter.sandbox.spawn import PRIVATE_TMP

    ballast = [os.open("/dev/null", os.O_RDONLY) for _ in range(120)]
    inheritable = os.open("/dev/null", os.O_RDONLY)
    os.set_inheritable(inheritable, True)
    try:
        assert min(ballast[-10:]) > 64
        t0 = time.monotonic()
        sb = sandboxes.spawn(rank_py, private_tmp=PRIVATE_TMP if private else None)
        spawn_s = time.monotonic() - t0
        Lines(sb.io.stdout).wait_for(r"^tick 1$")
        (rank,) = Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()
        rank_fds = {int(fd) for fd in os.listdir(f"/proc/{rank}/fd")}
        # Python's own fds in the rank open after start (none here but 0-4 at first).
        assert {0, 1, 2, 3, 4} <= rank_fds and not {fd for fd in rank_fds if fd > 4} - {5, 6}
        for fd in rank_fds - {0, 1, 2, 3, 4}:
            target = os.readlink(f"/proc/{rank}/fd/{fd}")
            assert not target.startswith("pipe:") or target in (
                f"pipe:[{v}]" for v in sb.io.inodes.values()
            ), target
        assert sorted(int(fd) for fd in os.listdir(f"/proc/{sb.pid}/fd")) == [0, 1, 2]
        assert spawn_s < 20  # it returned: the pid pipe reached EOF (no deadline hit)
    finally:
        for fd in (*ballast, inheritable):
            os.close(fd)


@pytest.mark.timeout(60)
def test_spawn_gives_up_at_its_deadline_and_leaves_nothing(
    sandboxes: Sandboxes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An init that never reports (here: a stand-in that sleeps) fails the spawn at the
    deadline with the reason; the stand-in is killed and reaped, and its pipes closed."""
    from snapshotter.sandbox import children

    fake = tmp_path / "snapinit"
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SNAPSHOTTER_SNAPINIT", str(fake))
    fds_before = len(os.listdir("/proc/self/fd"))
    kids_before = {pid for pid, _, _ in children.child_processes()}
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="did not report the sandbox's pid within 2s"):
        spawn(["true"], {}, tmp_path, init_cwd=tmp_path / "i", timeout=2)
    assert time.monotonic() - t0 < 10
    assert {pid for pid, _, _ in children.child_processes()} <= kids_before
    assert len(os.listdir("/proc/self/fd")) == fds_before
