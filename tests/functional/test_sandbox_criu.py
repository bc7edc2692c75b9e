"""Functional tests of the CRIU driver: real CRIU dumps and restores of real sandboxes.

Skipped where no CRIU >= 4.2 with pycriu is installed (deploy/install-criu.sh).
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from snapshotter.errors import CriuFailed, CriuUnavailable
from snapshotter.sandbox import criu
from snapshotter.sandbox.spawn import Sandbox
from tests.functional import test_sandbox_spawn as base
from tests.functional.test_sandbox_spawn import Lines, Sandboxes, ctl_roundtrip, last_int

# The rank program and sandbox fixtures are shared with the spawn tests.
subreaper = base.subreaper
rank_py = base.rank_py
sandboxes = base.sandboxes

T = TypeVar("T")


@pytest.fixture(autouse=True)
def need_criu() -> None:
    try:
        criu.criu_binary()
        criu._pycriu()
    except CriuUnavailable as e:
        pytest.skip(f"no usable CRIU here: {e}")


def in_parallel(*calls: Callable[[], T]) -> list[T]:
    """Run the calls in threads that start together; re-raise the first failure."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], T]) -> T:
        barrier.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as ex:
        futures = [ex.submit(run, c) for c in calls]
        return [f.result() for f in futures]


def wait_ticks(out: Lines, more: int) -> int:
    """Wait until `more` ticks after the last one seen; return the last tick seen."""
    if not any(ln.startswith("tick ") for ln in out.lines):
        out.wait_for(r"^tick ")
    out.wait_for(rf"^tick {last_int(out.lines, 'tick') + more}\b")
    return last_int(out.lines, "tick")


@pytest.mark.timeout(120)
def test_parallel_dumps_then_restore_continue(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    # Both ranks share a cwd; the inits have their own (spawn's init_cwd), which is what
    # keeps CRIU's temporary proc.crtools directories of the two dumps apart.
    work = tmp_path / "work"
    work.mkdir()
    originals = [sandboxes.spawn(rank_py, cwd=work) for _ in range(2)]
    outs = [Lines(sb.io.stdout) for sb in originals]
    before = [wait_ticks(out, 5) for out in outs]

    stats = in_parallel(
        *[
            lambda i=i: criu.dump(
                originals[i].pid,
                tmp_path / f"img{i}",
                leave_running=True,
                log_dir=tmp_path / f"log{i}",
            )
            for i in range(2)
        ]
    )
    for st in stats:
        assert st.images_bytes > 0 and st.log_path.is_file()
        assert st.frozen_time_us > 0
    after = [wait_ticks(out, 3) for out in outs]  # left running: they go on counting
    old_inodes = [sb.io.inodes for sb in originals]
    for sb in originals:
        sb.kill()
        assert sb.wait(10) == -9

    restored = in_parallel(
        *[
            lambda i=i: sandboxes.add(
                criu.restore(tmp_path / f"img{i}", old_inodes[i], log_dir=tmp_path / f"rlog{i}")
            )
            for i in range(2)
        ]
    )
    for i, sb in enumerate(restored):
        assert sb.io.inodes.keys() == old_inodes[i].keys()
        assert set(sb.io.inodes.values()).isdisjoint(old_inodes[i].values())
        out = Lines(sb.io.stdout)
        first = int(out.wait_for(r"^tick (\d+)$").group(1))
        # Continues from the dump: not from 1, not past where the original got to.
        assert before[i] < first <= after[i] + 1, (before[i], first, after[i])
        out.wait_for(rf"^tick {first + 2}$")
        Lines(sb.io.stderr).wait_for(r"^etick \d+$")
        assert ctl_roundtrip(sb, f"ping {i}") == f"ping {i}"
        status = Path(f"/proc/{sb.pid}/status").read_text()
        assert f"PPid:\t{os.getpid()}\n" in status
    # The restored init still forwards signals and propagates the rank's status.
    for sb in restored:
        sb.send_signal(15)
        assert sb.wait(10) == 42


@pytest.mark.timeout(120)
def test_restore_a_copy_while_the_original_runs(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    original = sandboxes.spawn(rank_py)
    out = Lines(original.io.stdout)
    wait_ticks(out, 3)
    criu.dump(original.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log")
    # Two copies at once, from the same images, logging into the same directory.
    copies: list[Sandbox] = in_parallel(
        *[
            lambda: sandboxes.add(
                criu.restore(tmp_path / "img", original.io.inodes, log_dir=tmp_path / "l")
            )
            for _ in range(2)
        ]
    )
    assert len({original.pid, *(c.pid for c in copies)}) == 3
    copy_outs = [Lines(c.io.stdout) for c in copies]
    for o in copy_outs:
        wait_ticks(o, 2)
    wait_ticks(out, 2)
    # Independent control channels: each answers only what it was sent.
    for name, sb in [("original", original), ("copy0", copies[0]), ("copy1", copies[1])]:
        assert ctl_roundtrip(sb, f"who {name}") == f"who {name}"
    copies[0].kill()
    assert copies[0].wait(10) == -9
    wait_ticks(out, 2)
    wait_ticks(copy_outs[1], 2)
    assert original.poll() is None and copies[1].poll() is None


@pytest.mark.timeout(60)
def test_dump_of_missing_pid_raises_criu_failed(tmp_path: Path) -> None:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    pid = next(p for p in range(pid_max - 1, 1, -1) if not os.path.exists(f"/proc/{p}"))
    with pytest.raises(CriuFailed) as info:
        criu.dump(pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log")
    err = info.value
    assert err.action == "dump"
    assert Path(err.log_path).is_file() and Path(err.log_path).parent == tmp_path / "log"
    assert err.tail and any("Error" in ln for ln in err.tail)
    assert err.__cause__ is not None  # pycriu's exception is kept
    assert err.log_path in str(err)


@pytest.mark.timeout(60)
def test_an_established_connection_stays_up_and_comes_back_closed(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    """A rank's connection to an outside service: the dump leaves it established in the rank
    that goes on, and the restored copy finds it closed (its client would reconnect)."""
    from snapshotter.hook.sockets import tcp_sockets

    def to_server(pid: int, port: int) -> list[str]:
        rank = int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
        return [s.state for s in tcp_sockets(rank) if s.remote.endswith(f":{port}")]

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        sb = sandboxes.spawn(rank_py, "--tcp", str(port))
        server.settimeout(10)
        conn, _ = server.accept()
        with conn:
            out = Lines(sb.io.stdout)
            wait_ticks(out, 2)
            criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "l")
            wait_ticks(out, 2)
            assert to_server(sb.pid, port) == ["ESTABLISHED"]
            conn.sendall(b"still here\n")  # the original's connection works after the dump
            copy = sandboxes.add(criu.restore(tmp_path / "img", sb.io.inodes,
                                              log_dir=tmp_path / "rl"))  # fmt: skip
            wait_ticks(Lines(copy.io.stdout), 2)
            assert "ESTABLISHED" not in to_server(copy.pid, port)
            assert to_server(sb.pid, port) == ["ESTABLISHED"]


def test_a_connection_carries_on_after_a_dump_that_left_the_tree_stopped(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    """What a freeze does (the tree left stopped while files are copied, then continued):
    the rank's connection to an outside service carries requests and replies as before.
    CRIU leaves the sockets of a tree it leaves stopped in TCP repair mode, where nothing
    sent goes out: the job's client then waited for its timeout (10 s) and reconnected."""

    def round_trip(conn: socket.socket, data: bytes) -> bytes:
        conn.sendall(data)
        got = b""
        while not got.endswith(b"\n"):
            chunk = conn.recv(4096)
            assert chunk, "the rank closed the connection"
            got += chunk
        return got

    with socket.create_server(("127.0.0.1", 0)) as server:
        sb = sandboxes.spawn(rank_py, "--tcp", str(server.getsockname()[1]), "--tcp-echo")
        server.settimeout(10)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            assert round_trip(conn, b"before\n") == b"before\n"
            stopped = []
            criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "l",
                      while_stopped=stopped.append)  # fmt: skip
            assert stopped == [tmp_path / "img"]
            try:
                echoed = round_trip(conn, b"after\n")
            except TimeoutError:
                echoed = b"(nothing within 10 s)"
            assert echoed == b"after\n"


@pytest.mark.timeout(120)
def test_rank_with_worker_pipe_and_unlinked_shm_survives(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    # Like a DataLoader: a forked worker feeding the rank through a pipe, and an unlinked
    # /dev/shm file (4 MiB: over CRIU's default 1 MiB ghost limit) mapped by the rank.
    sb = sandboxes.spawn(rank_py, "--child", "--shm", "4")
    out = Lines(sb.io.stdout)
    out.wait_for(r"^child 3$")
    out.wait_for(r"^tick \d+ shm-ok!$")
    criu.dump(sb.pid, tmp_path / "img", leave_running=False, log_dir=tmp_path / "log")
    assert sb.wait(10) == -9  # a freeze: CRIU kills the tree once it is dumped
    out.drain(5)
    assert out.eof
    last_child, last_tick = last_int(out.lines, "child"), last_int(out.lines, "tick")

    restored = sandboxes.add(criu.restore(tmp_path / "img", sb.io.inodes, log_dir=tmp_path / "l"))
    new = Lines(restored.io.stdout)
    # Exactly where the frozen one stopped: data in the worker pipe and in the rank's
    # buffers came back with it.
    first_child = int(new.wait_for(r"^child (\d+)$").group(1))
    assert first_child == last_child + 1
    assert int(new.wait_for(r"^tick (\d+)").group(1)) == last_tick + 1
    new.wait_for(rf"^child {first_child + 3}$")
    new.wait_for(r"^tick \d+ shm-ok!$")
    (rank,) = Path(f"/proc/{restored.pid}/task/{restored.pid}/children").read_text().split()
    assert len(Path(f"/proc/{rank}/task/{rank}/children").read_text().split()) == 1


@pytest.mark.timeout(60)
def test_old_criu_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv(criu.ENV_VAR, str(fake))
    with pytest.raises(CriuUnavailable, match="install-criu"):
        criu.criu_binary()


@pytest.mark.timeout(120)
def test_move_between_network_namespaces(
    sandboxes: Sandboxes, rank_py: Path, tmp_path: Path
) -> None:
    names = [f"snapt-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    made = []
    try:
        for name in names:
            if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
                pytest.skip("cannot create network namespaces here")
            made.append(name)
            # criu probes TCP repair over loopback at start: a node's netns has lo up.
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        sb = sandboxes.spawn(rank_py, netns=names[0])
        out = Lines(sb.io.stdout)
        wait_ticks(out, 2)
        # criu enters the rank's network namespace itself: the namespace is not dumped.
        criu.dump(sb.pid, tmp_path / "img", leave_running=False, log_dir=tmp_path / "log")
        assert sb.wait(10) == -9
        moved = sandboxes.add(
            criu.restore(tmp_path / "img", sb.io.inodes, log_dir=tmp_path / "l", netns=names[1])
        )
        wait_ticks(Lines(moved.io.stdout), 2)
        (rank,) = Path(f"/proc/{moved.pid}/task/{moved.pid}/children").read_text().split()
        target = os.stat(f"/run/netns/{names[1]}").st_ino
        for pid in (str(moved.pid), rank):
            assert os.stat(f"/proc/{pid}/ns/net").st_ino == target
            assert os.readlink(f"/proc/{pid}/ns/mnt") == os.readlink("/proc/self/ns/mnt")
    finally:
        sandboxes.cleanup()
        sandboxes.all.clear()
        for name in made:
            subprocess.run(["ip", "netns", "delete", name], check=False)


# The rank binds a unix listener under its TMPDIR (as multiprocessing's resource_sharer does
# for DataLoader workers) and a forked worker talks to it; every answer names the mount
# namespace of the process that gave it.
LISTENER_SRC = r"""
import os, socket, sys, threading, time
d = os.path.join(os.environ["TMPDIR"], "pymp-x")
os.makedirs(d)
path = os.path.join(d, "listener-1")
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(16)
count = 0
def serve():
    global count
    while True:
        c, _ = srv.accept()
        count += 1
        c.sendall(f"{count} {os.readlink('/proc/self/ns/mnt')}\n".encode())
        c.close()
threading.Thread(target=serve, daemon=True).start()
if os.fork() == 0:
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        os.write(1, b"worker " + s.recv(100))
        s.close()
        time.sleep(0.05)
while True:
    time.sleep(1)
"""


def _ask(sb: Sandbox, tmp: str) -> tuple[int, str]:
    # The path inside the copy's own mount namespace.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(f"/proc/{sb.pid}/root{tmp}/pymp-x/listener-1")
        count, ns = s.recv(100).decode().split()
    return int(count), ns


@pytest.mark.timeout(120)
def test_forks_of_one_snapshot_have_private_tmpdirs(sandboxes: Sandboxes, tmp_path: Path) -> None:
    from snapshotter.sandbox.spawn import PRIVATE_TMP

    rank = tmp_path / "listener.py"
    rank.write_text(LISTENER_SRC)
    original = sandboxes.spawn(rank, private_tmp=PRIVATE_TMP)
    tmp = str(PRIVATE_TMP)
    assert not os.path.exists(f"{tmp}/pymp-x")  # the host never sees the sandbox's TMPDIR
    out = Lines(original.io.stdout)
    out.wait_for(r"^worker 3 ")
    criu.dump(original.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log")
    copies = in_parallel(
        *[
            lambda: sandboxes.add(
                criu.restore(tmp_path / "img", original.io.inodes, log_dir=tmp_path / "l")
            )
            for _ in range(2)
        ]
    )
    copy_outs = [Lines(c.io.stdout) for c in copies]
    everyone = [original, *copies]
    mnt = [os.readlink(f"/proc/{sb.pid}/ns/mnt") for sb in everyone]
    assert len(set(mnt)) == 3 and os.readlink("/proc/self/ns/mnt") not in mnt
    # Each worker's connections reach its own rank's listener, never another copy's.
    # (A copy's pipe starts with what the original had written but nobody read at the dump.)
    for i, o in enumerate([out, *copy_outs]):
        o.wait_for(r"^worker ")
        seen = len(o.lines)
        for k in range(3):
            assert o.wait_for(r"^worker \d+ (\S+)$", start=seen + k).group(1) == mnt[i]
    # From outside, each copy's socket answers with its own namespace and its own count (its
    # worker connects too, every 50 ms, so the count may have moved on by more than one).
    for i, sb in enumerate(everyone):
        first, ns = _ask(sb, tmp)
        assert ns == mnt[i]
        second, ns = _ask(sb, tmp)
        assert ns == mnt[i] and second > first
    assert not os.path.exists(f"{tmp}/pymp-x")
    for sb in everyone:
        assert sb.poll() is None


@pytest.mark.timeout(120)
def test_restored_sandbox_keeps_its_own_proc(sandboxes: Sandboxes, tmp_path: Path) -> None:
    from snapshotter.sandbox.spawn import PRIVATE_TMP

    prog = tmp_path / "proc.py"
    prog.write_text(base.PROC_SRC)
    original = sandboxes.spawn(prog, private_tmp=PRIVATE_TMP)
    Lines(original.io.stdout).wait_for(r"^pid 2 procself 2$")
    criu.dump(original.pid, tmp_path / "img", leave_running=False, log_dir=tmp_path / "log")
    copy = sandboxes.add(criu.restore(tmp_path / "img", original.io.inodes,
                                      log_dir=tmp_path / "rlog"))
    out = Lines(copy.io.stdout)
    out.wait_for(r"^pid ")
    seen = len(out.lines)
    assert out.wait_for(r"^pid (\d+) procself (\d+)$", start=seen).groups() == ("2", "2")


# Writes a line a tick to a file it keeps open for writing ('w'): the file's size at the dump
# is not its size later, which CRIU refuses at restore ("has bad size").
GROWING_FILE_SRC = r"""
import os, sys, time
f = open(sys.argv[1], "w")
n = 0
while True:
    n += 1
    f.write(f"line {n}\n"); f.flush()
    os.write(1, f"tick {n}\n".encode())
    time.sleep(0.02)
"""


@pytest.mark.timeout(120)
def test_a_failed_restore_leaves_no_process_and_no_zombie(
    sandboxes: Sandboxes, tmp_path: Path
) -> None:
    """CRIU forks the restored root as our child before it finds the file changed; when it
    gives up, that child is a zombie nobody knows the pid of. The driver reaps it."""
    from snapshotter.procutil import child_processes

    prog = tmp_path / "grow.py"
    prog.write_text(GROWING_FILE_SRC)
    sb = sandboxes.spawn(prog, str(tmp_path / "metrics.csv"))
    out = Lines(sb.io.stdout)
    wait_ticks(out, 2)
    criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log")
    wait_ticks(out, 5)  # the file grows past what the images recorded
    before = {pid for pid, _, _ in child_processes()}
    with pytest.raises(CriuFailed, match="bad size"):
        criu.restore(tmp_path / "img", sb.io.inodes, log_dir=tmp_path / "rlog")
    left = [(pid, state, comm) for pid, state, comm in child_processes() if pid not in before]
    assert left == [], f"the failed restore left children behind: {left}"
    assert sb.poll() is None  # the original is untouched


BIG = """
import sys, time
block = bytearray(700 << 20)
for i in range(0, len(block), 4096):
    block[i] = i % 251  # every page touched: the dump writes them all
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_a_rank_killed_during_its_dump_fails_the_dump_at_once(
    sandboxes: Sandboxes, tmp_path: Path
) -> None:
    """A task killed while CRIU holds its tree stays a zombie nobody can reap, and CRIU waits
    for it to trap (3 minutes, seen in a resilience test): the dump ends CRIU instead, fails,
    and the rest of the tree runs on (the init here; its agent then ends the job)."""
    prog = tmp_path / "big.py"
    prog.write_text(BIG)
    sb = sandboxes.spawn(prog)
    Lines(sb.io.stdout).wait_for("^ready$", timeout=60)
    rank = int(Path(f"/proc/{sb.pid}/task/{sb.pid}/children").read_text().split()[0])
    log_dir = tmp_path / "log"

    def kill_mid_dump() -> None:
        for _ in range(3000):  # once CRIU dumps pages through its parasite
            logs = list(log_dir.glob("dump-*.log")) if log_dir.is_dir() else []
            if logs and b"Sent msg to daemon" in logs[0].read_bytes():
                break
            threading.Event().wait(0.002)
        os.kill(rank, 9)

    killer = threading.Thread(target=kill_mid_dump)
    killer.start()
    with pytest.raises(CriuFailed):
        criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=log_dir)
    killer.join()
    assert sb.wait(30) is not None  # the init saw its rank die and ended
