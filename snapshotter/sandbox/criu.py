"""CRIU driver: dump a sandbox's process tree to images, restore a tree from images.

Talks to CRIU only through pycriu's RPC against a private `criu swrk` per call, so dumps and
restores of different sandboxes run in parallel without sharing state. We start swrk
ourselves (pass_fds) instead of pycriu's `use_binary()`, which forks the threaded agent in
Python and hands the child every inheritable fd of the process: the fds swrk needs (its RPC
socket, the new pipes for `inherit_fd`) must be in that one swrk and in no other child.

A sandbox's rank talks to the world through pipes owned by the agent (see spawn.py). CRIU
dumps them as pipes with a peer outside the tree; on restore each old pipe `pipe:[INO]` is
bound to a fresh pipe through `inherit_fd`, so the agent gets new ends.

A sandbox with a private tmpfs (spawn's default) has its own mount namespace: the host's
mounts, made private, plus the tmpfs. Dumps set auto_ext_mnt, so CRIU records every host
mount as an external bind ("autodetected": the host path it came from) and dumps only the
tmpfs, contents and all; restores set auto_ext_mnt and root="/", so CRIU builds a new mount
namespace from this machine's mounts at the same paths plus a fresh copy of the tmpfs. The
restoring machine must therefore have those host mounts at the same paths.

Never shells out to `criu dump`/`criu restore`, never sets shell_job (ranks have no terminal).
The ranks close their communicators' and store's sockets before a dump; the only TCP sockets
left are the job's own connections to outside services, dumped established and restored
closed (needs CRIU >= 4.2 on Linux >= 6.16: MIN_VERSION).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshotter.errors import CriuFailed, CriuUnavailable, SandboxError
from snapshotter.procutil import proc_state, sandbox_pids
from snapshotter.sandbox import children, tcp_repair
from snapshotter.sandbox.images import ensure_mountpoints, ensure_socket_dirs, has_mount_ns
from snapshotter.sandbox.spawn import PIPE_NAMES, Sandbox, is_subreaper, netns_path, new_pipes

ENV_VAR = "SNAPSHOTTER_CRIU"
DEFAULT_CRIU = Path("/opt/snapshotter/criu/bin/criu")
# 4.2: CRIU 4.1 reads SO_PASSCRED from every socket, which Linux 6.16 refuses for TCP.
MIN_VERSION = (4, 2)
LOG_LEVEL = 4
# PyTorch DataLoader workers pass tensors through unlinked /dev/shm files; CRIU copies
# unlinked files into the images ("ghosts") only up to this size each (default 1 MiB).
GHOST_LIMIT = 1 << 30
TAIL_LINES = 15
_INSTALL_HINT = "run deploy/install-criu.sh (or set $SNAPSHOTTER_CRIU to a CRIU >= 4.2)"
_SWRK_EXIT_TIMEOUT = 30.0
# How often a running dump checks that its tree is whole.
WATCH_S = 0.3
# A CRIU call still running after this is stuck (a dump moves GB/s; these are hours of it).
DUMP_TIMEOUT_S = 3600.0
RESTORE_TIMEOUT_S = 3600.0
_seq = itertools.count(1)
log = logging.getLogger(__name__)
_LOCK_DIR = Path(tempfile.gettempdir()) / "snapshotter-criu-locks"


@dataclass(frozen=True)
class DumpStats:
    """What one dump cost. Times in microseconds are CRIU's own (stats-dump)."""

    wall_s: float
    images_bytes: int
    log_path: Path
    freezing_time_us: int = 0
    frozen_time_us: int = 0
    memdump_time_us: int = 0
    memwrite_time_us: int = 0
    pages_written: int = 0


@functools.lru_cache(maxsize=8)
def _checked(path: str) -> Path:
    try:
        out = children.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CriuUnavailable(f"cannot run {path} --version: {e}", _INSTALL_HINT) from e
    m = re.search(r"Version:\s*(\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or m is None:
        raise CriuUnavailable(
            f"{path} --version failed (exit {out.returncode}): {out.stderr.strip()[-300:]}",
            _INSTALL_HINT,
        )
    version = (int(m.group(1)), int(m.group(2)))
    if version < MIN_VERSION:
        raise CriuUnavailable(
            f"{path} is CRIU {version[0]}.{version[1]}; snapshotter needs >= 4.2 (older ones "
            "cannot dump a process holding a TCP socket on Linux >= 6.16, or fail on its vDSO "
            "layout)",
            _INSTALL_HINT,
        )
    return Path(path)


def criu_binary() -> Path:
    """$SNAPSHOTTER_CRIU, else /opt/snapshotter/criu/bin/criu, else `criu` on PATH.

    Raises:
        CriuUnavailable: none found, or the one found is older than 4.2 or does not run.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        return _checked(override)
    if os.access(DEFAULT_CRIU, os.X_OK):
        return _checked(str(DEFAULT_CRIU))
    found = shutil.which("criu")
    if found is None:
        raise CriuUnavailable(f"no CRIU: not at {DEFAULT_CRIU} nor on PATH", _INSTALL_HINT)
    return _checked(found)


def _pycriu() -> Any:
    try:
        import pycriu  # type: ignore[import-not-found]
    except ImportError as e:
        raise CriuUnavailable(f"pycriu is not importable: {e}", _INSTALL_HINT) from e
    return pycriu


def dump(
    pid: int,
    images_dir: Path,
    *,
    leave_running: bool,
    log_dir: Path,
    timeout: float = DUMP_TIMEOUT_S,
    while_stopped: Callable[[Path], object] | None = None,
) -> DumpStats:
    """Dump the tree rooted at `pid` (a sandbox init) into `images_dir`.

    `log_dir` is CRIU's work dir: it gets `dump-<pid>-<n>.log`; give each sandbox its own.
    A task in another network namespace is dumped by a criu running in that namespace, so
    the namespace itself is not dumped. With `while_stopped` (and leave_running), CRIU leaves
    every task stopped after the dump, `while_stopped(images_dir)` runs, and only then does
    the tree go on: what it does sees the tree exactly as the images do (files.py keeps the
    files the ranks write that way).

    Raises:
        CriuUnavailable: no usable CRIU or pycriu.
        CriuFailed: the dump failed (log path and last error lines attached); with
            leave_running=False the tree is left running by CRIU on failure.
    """
    pycriu = _pycriu()
    images_dir.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_name = f"dump-{pid}-{next(_seq)}.log"
    netns = _foreign_netns(pid)

    stop_after = while_stopped is not None and leave_running

    def configure(opts: Any) -> None:
        opts.pid = pid
        opts.leave_running = leave_running
        opts.leave_stopped = stop_after
        # Connections the job opened to outside services are dumped as they are (repair
        # mode, and back to normal for a tree left running); a restore brings them back
        # closed. No network lock: it needs iptables/nft, and the connections are the job's
        # own (a peer's packet during the dump's milliseconds is retransmitted).
        opts.tcp_established = True
        opts.network_lock = pycriu.rpc.SKIP
        opts.ghost_limit = GHOST_LIMIT
        opts.file_locks = True
        # Host mounts in a private-tmp sandbox's namespace: external (no-op without one).
        opts.auto_ext_mnt = True

    start = time.monotonic()
    try:
        with _root_cwd_lock(pid):
            before = _dead_tasks(pid)  # zombies of the tree CRIU dumps as such

            def gave_out() -> str | None:
                died = _dead_tasks(pid) - before
                return f"process(es) {sorted(died)} of the tree died in the dump" if died else None

            _call(pycriu, "dump", images_dir, log_dir, log_name, configure, (), netns, timeout,
                  gave_out=gave_out)  # fmt: skip
        if while_stopped is not None:
            while_stopped(images_dir)
    finally:
        if stop_after:
            # CRIU left the sockets of the tree it left stopped in TCP repair mode.
            tcp_repair.repair_off([pid, *sandbox_pids(pid)])
            continue_tree(pid)
    wall = time.monotonic() - start
    return _dump_stats(images_dir, log_dir, log_dir / log_name, wall)


def restore(
    images_dir: Path,
    io_inodes: Mapping[str, int],
    *,
    log_dir: Path,
    netns: str | None = None,
    timeout: float = RESTORE_TIMEOUT_S,
) -> Sandbox:
    """Restore the tree in `images_dir` as a new sandbox, a child of this process.

    `io_inodes` are the old pipes (RankIO.inodes of the dumped sandbox); each is replaced by
    a new pipe, whose agent ends come back in the Sandbox's `io`. The same images can be
    restored again while the original or another copy runs: each copy has its own PID
    namespace. `netns` puts the copy in that network namespace (criu runs inside it).

    Raises:
        CriuUnavailable: no usable CRIU or pycriu.
        CriuFailed: the restore failed (log path and last error lines attached).
        SandboxError: the caller is not a child subreaper, or `netns` does not exist.
    """
    pycriu = _pycriu()
    if not is_subreaper():
        raise SandboxError(
            "restore() needs a child subreaper: the restored init must stay our child",
            "call snapshotter.sandbox.spawn.become_subreaper() once at agent start",
        )
    log_dir.mkdir(parents=True, exist_ok=True)
    ensure_mountpoints(images_dir)
    ensure_socket_dirs(images_dir)
    mount_ns = has_mount_ns(images_dir)
    log_name = f"restore-{next(_seq)}.log"
    ns_path = netns_path(netns) if netns is not None else None
    io, rank = new_pipes()
    inherit = {f"pipe:[{io_inodes[n]}]": rank[n] for n in PIPE_NAMES if n in io_inodes}

    def configure(opts: Any) -> None:
        # The root is forked as our child (CLONE_PARENT) instead of criu's: no window in
        # which it is nobody's child, and waitpid() works at once.
        opts.rst_sibling = True
        # The job's connections to outside services come back closed: the job sees a reset
        # and reconnects (the peer forgot the connection long ago, or another copy owns it).
        opts.tcp_close = True
        opts.file_locks = True
        if mount_ns:  # a new mount namespace: this machine's "/" and mounts, our tmpfs
            opts.root = "/"
            opts.auto_ext_mnt = True
        for key, fd in inherit.items():
            entry = opts.inherit_fd.add()
            entry.key = key
            entry.fd = fd  # a number in the criu process: passed to it with pass_fds

    # The restored root is forked as our child before its pid is known (and stays one, a
    # zombie, when the restore fails after that): no reaper may run meanwhile.
    try:
        with children.spawning():
            try:
                resp = _call(
                    pycriu, "restore", images_dir, log_dir, log_name, configure,
                    inherit.values(), ns_path, timeout,
                )  # fmt: skip
                return Sandbox(resp.pid, io)
            except BaseException:
                io.close()
                raise
            finally:
                for fd in rank.values():
                    os.close(fd)
    except BaseException:
        # What CRIU forked as our child and killed when it gave up (the agent's reaper takes
        # it later if another spawn is running now).
        children.reap_strays()
        raise


def _call(
    pycriu: Any,
    action: str,
    images_dir: Path,
    log_dir: Path,
    log_name: str,
    configure: Callable[[Any], None],
    pass_fds: Iterable[int],
    netns: Path | None,
    timeout: float,
    gave_out: Callable[[], str | None] | None = None,
) -> Any:
    """One RPC request to a private `criu swrk`; returns pycriu's answer (resp.dump/.restore).
    A swrk still working after `timeout` seconds is killed: the RPC then fails like any
    other CRIU failure (CRIU's ptrace seizure ends with it, so the tree runs on)."""
    criu = criu_binary()
    log_path = log_dir / log_name
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    images_fd = os.open(images_dir, os.O_DIRECTORY | os.O_CLOEXEC)
    work_fd = os.open(log_dir, os.O_DIRECTORY | os.O_CLOEXEC)
    cmd = [str(criu), "swrk", str(theirs.fileno())]
    if netns is not None:  # only the network namespace: a mount namespace breaks CRIU
        cmd = ["nsenter", f"--net={netns}", "--", *cmd]
    with tempfile.TemporaryFile() as stderr:
        try:
            swrk = children.popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(theirs.fileno(), *pass_fds),
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            theirs.close()
            os.close(images_fd)
            os.close(work_fd)
            raise CriuUnavailable(f"cannot start {cmd[0]}: {e}", _INSTALL_HINT) from e
        theirs.close()
        watchdog = threading.Timer(timeout, _kill_overdue, args=(swrk, action, timeout))
        watchdog.daemon = True
        watchdog.start()
        done = threading.Event()
        if gave_out is not None:
            threading.Thread(target=_watch, args=(swrk, action, gave_out, done), daemon=True,
                             name=f"criu-{action}-watch").start()  # fmt: skip
        try:
            client = pycriu.criu()
            client.use_fd(ours.fileno())
            # images_dir_fd/work_dir_fd are fds of *this* process: swrk opens them as
            # /proc/<peer pid>/fd/N. inherit_fd numbers, by contrast, are swrk's own.
            client.opts.images_dir_fd = images_fd
            client.opts.work_dir_fd = work_fd
            client.opts.log_file = log_name
            client.opts.log_level = LOG_LEVEL
            client.opts.shell_job = False
            client.opts.tcp_established = False
            configure(client.opts)
            return getattr(client, action)()
        except pycriu.CRIUException as e:
            _wait(swrk)
            stderr.seek(0)
            extra = stderr.read().decode(errors="replace").splitlines()
            raise CriuFailed(
                action, str(log_path), _tail(log_path, [*extra, str(e)]),
                first=first_error(log_path),
            ) from e  # fmt: skip
        finally:
            done.set()
            watchdog.cancel()
            ours.close()
            os.close(images_fd)
            os.close(work_fd)
            _wait(swrk)


def continue_tree(pid: int) -> None:
    """SIGCONT every process of the tree rooted at `pid` (CRIU's leave_stopped stops them
    all; continuing only the root would leave its children stopped)."""
    for p in [pid, *sandbox_pids(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGCONT)


def _dead_tasks(pid: int) -> set[int]:
    """The tree's tasks that died and are not reaped. One that dies while CRIU holds the tree
    stays so (its parent is seized too), and CRIU waits for it to trap: for minutes, seen here
    when a rank was killed during its dump."""
    return {p for p in [pid, *sandbox_pids(pid)] if proc_state(p) in ("Z", "X")}


def _watch(
    swrk: subprocess.Popen[bytes], action: str, gave_out: Callable[[], str | None],
    done: threading.Event,
) -> None:  # fmt: skip
    """Kill swrk once `gave_out` names a reason: CRIU then fails at once, and its ptrace
    seizure ends, so what is left of the tree runs on."""
    while not done.wait(WATCH_S):
        why = gave_out()
        if why is not None and not done.is_set():
            log.warning("criu %s stopped (pid %d): %s", action, swrk.pid, why)
            swrk.kill()
            return


def _kill_overdue(swrk: subprocess.Popen[bytes], action: str, timeout: float) -> None:
    log.error("criu %s still running after %.0fs; killing it (pid %d)", action, timeout, swrk.pid)
    swrk.kill()


def _wait(swrk: subprocess.Popen[bytes]) -> None:
    try:
        swrk.wait(timeout=_SWRK_EXIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        swrk.kill()
        swrk.wait()


# "(00.046000)      2: Error (criu/files-reg.c:2175): File x has bad size 837 (expect 407)"
_ERROR_LINE = re.compile(r"^\(\s*[\d.]+\)\s+(?:\d+:\s+)?Error \(([^)]*)\):\s*(.*)$")


def first_error(log_path: Path) -> str:
    """CRIU's first real error in a log, as "what (where)": the cause, where the lines after it
    are its consequences ("Unable to open fd", "Restoring FAILED")."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for ln in lines:
        m = _ERROR_LINE.match(ln.strip())
        if m and "RLIMIT_NOFILE" not in ln:
            return f"{m.group(2).strip()} ({m.group(1)})"
    return ""


def _tail(log_path: Path, extra: list[str]) -> list[str]:
    """Last error lines of a CRIU log, else its last lines, else what swrk/pycriu said."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    # Every run logs a harmless RLIMIT_NOFILE error (no CAP_SYS_RESOURCE): not a cause.
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    tail = (errors or lines)[-TAIL_LINES:]
    return tail + [ln for ln in extra if ln.strip()][-3:]


@contextlib.contextmanager
def _root_cwd_lock(pid: int) -> Iterator[None]:
    """Serialize dumps whose root tasks share a cwd (across threads and processes).

    CRIU's parasite makes and removes `proc.crtools` in the root task's cwd (the sandbox
    init's, when /proc is not its pid namespace's); two dumps at once there fail with
    "Can't create a directory (-17)". spawn() gives each init its own cwd, so this only
    waits for copies restored from the same images, which share their init's cwd.
    """
    try:
        st = os.stat(f"/proc/{pid}/cwd")
    except OSError:
        yield  # no such pid (criu reports it) or cwd unreadable: nothing to share
        return
    _LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with open(_LOCK_DIR / f"{st.st_dev}-{st.st_ino}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # per open file: threads of one process exclude too
        yield


def _foreign_netns(pid: int) -> Path | None:
    """/proc/PID/ns/net if PID's network namespace is not ours (criu must then enter it)."""
    path = Path(f"/proc/{pid}/ns/net")
    try:
        if os.stat(path).st_ino != os.stat("/proc/self/ns/net").st_ino:
            return path
    except OSError:
        pass  # no such pid: let criu report it
    return None


def _dump_stats(images_dir: Path, log_dir: Path, log_path: Path, wall: float) -> DumpStats:
    size = sum(p.stat().st_size for p in images_dir.iterdir() if p.is_file())
    fields: dict[str, int] = {}
    stats = log_dir / "stats-dump"  # CRIU writes it into its work dir
    try:
        with open(stats, "rb") as f:
            entry = _pycriu().images.load(f)["entries"][0]["dump"]
        fields = {
            f"{k}_us": int(entry.get(k, 0))
            for k in ("freezing_time", "frozen_time", "memdump_time", "memwrite_time")
        }
        fields["pages_written"] = int(entry.get("pages_written", 0))
        os.replace(stats, images_dir / "stats-dump")
    except (OSError, KeyError, IndexError, ValueError):
        pass  # stats are informative only
    return DumpStats(wall_s=wall, images_bytes=size, log_path=log_path, **fields)
