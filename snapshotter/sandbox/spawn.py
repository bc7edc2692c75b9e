"""Start one rank in its own sandbox: a fresh PID namespace whose pid 1 is `snapinit`.

The process tree is `caller (child subreaper) -> init -> rank`, the same after `spawn()` as
after a CRIU restore, so the agent treats both alike: it owns the rank's stdio and control
pipes (their inodes are what CRIU calls the external pipes) and waits on the init's pid.

Rank fds: 0 = /dev/null, 1/2 = stdout/stderr pipes, 3 = control commands in (agent -> rank),
4 = control replies out (rank -> agent). Nothing else leaks into the sandbox.

With `private_tmp` the sandbox also has a mount namespace of its own (snapinit --private-tmp):
the host's mounts, private, plus a fresh tmpfs on PRIVATE_TMP, which is the rank's TMPDIR. CRIU
dumps that tmpfs with the tree (criu.py), so copies restored from one snapshot on one machine
each have their own TMPDIR: Python multiprocessing's listener sockets (DataLoader workers'
resource_sharer) do not clash. Everything else (/tmp, /dev/shm, the job's files) is the host's.

This module never calls waitpid(-1) (it would steal other children's statuses: see
children.py for how children are owned), never waits without a deadline, and never uses
`ip netns exec`: its mount namespace shares mounts with the host, which CRIU cannot dump.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from snapshotter.errors import SandboxError
from snapshotter.sandbox import children
from snapshotter.sandbox.initbin import snapinit_path

log = logging.getLogger(__name__)

PIPE_NAMES = ("stdout", "stderr", "ctl_in", "ctl_out")
RANK_CTL_IN_FD = 3
RANK_CTL_OUT_FD = 4
# The mountpoint of each sandbox's private tmpfs (an empty host directory, shared by all
# sandboxes as a mountpoint only). A fixed path: a restore must find the same one.
PRIVATE_TMP = Path("/tmp/snapshotter-private-tmp")
# snapinit reports within milliseconds; this only bounds a node so loaded it stalls.
SPAWN_TIMEOUT_S = 30.0

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


class RankIO:
    """The agent's ends of a rank's pipes (all O_CLOEXEC) and the pipes' inodes.

    stdout/stderr/ctl_out are read ends, ctl_in is a write end. `inodes` maps each name in
    PIPE_NAMES to the pipe's inode, the `N` in CRIU's `pipe:[N]`.

    Every end has exactly one owner that closes it: this object until `take()` hands the end
    over (to a log pump, a control channel), the new owner from then on. `close()` closes only
    the ends never taken, so no fd number is ever closed twice (a second close could hit an
    unrelated descriptor that reused the number).
    """

    def __init__(self, fds: Mapping[str, int], inodes: Mapping[str, int]) -> None:
        self._fds: dict[str, int] = dict(fds)
        self._taken: set[str] = set()
        self.inodes: Mapping[str, int] = dict(inodes)
        self._lock = threading.Lock()

    @property
    def stdout(self) -> int:
        return self._fds["stdout"]

    @property
    def stderr(self) -> int:
        return self._fds["stderr"]

    @property
    def ctl_in(self) -> int:
        return self._fds["ctl_in"]

    @property
    def ctl_out(self) -> int:
        return self._fds["ctl_out"]

    def take(self, *names: str) -> tuple[int, ...]:
        """Hand the named ends to a new owner, which closes them from now on."""
        with self._lock:
            taken = [n for n in names if n in self._taken]
            if taken:
                raise RuntimeError(f"rank pipe end(s) {taken} were already handed over")
            self._taken.update(names)
            return tuple(self._fds[n] for n in names)

    def close(self) -> None:
        with self._lock:
            left = [n for n in self._fds if n not in self._taken]
            self._taken.update(left)
        for n in left:
            try:
                os.close(self._fds[n])
            except OSError:
                pass


class Sandbox:
    """A running sandbox seen from its parent: the init's host pid and the rank's pipes.

    Owns the init as a child (registered with children.own until it is reaped) and a pidfd
    for it; `close()` releases both once the init was waited for.
    """

    def __init__(self, pid: int, io: RankIO) -> None:
        self.pid = pid
        self.io = io
        self.returncode: int | None = None
        self._lock = threading.Lock()
        children.own(pid)
        # A pidfd pins the process (even once reaped): signals never reach a recycled pid.
        self._pidfd = os.pidfd_open(pid)

    def __repr__(self) -> str:
        return f"Sandbox(pid={self.pid}, returncode={self.returncode})"

    def wait(self, timeout: float | None = None) -> int | None:
        """Reap the init; return its exit status (-N if killed by signal N), None on timeout.

        The init exits with the rank's status, or 128+N if the rank was killed by signal N.
        Safe to call from several threads, and alongside send_signal().
        """
        if self.returncode is None:
            with self._lock:
                pidfd = self._pidfd
            if pidfd < 0:
                return self.returncode
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)  # readable once the init has exited
            if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
                return None
            with self._lock:
                if self.returncode is None:
                    self.returncode = self._reap()
        return self.returncode

    def _reap(self) -> int:
        """The exit status of the init, which has exited (called once, under the lock)."""
        _, status = os.waitpid(self.pid, 0)
        children.release(self.pid)
        return os.waitstatus_to_exitcode(status)

    def poll(self) -> int | None:
        return self.wait(timeout=0)

    def send_signal(self, sig: int) -> None:
        """Signal the init, which forwards TERM/INT/HUP/USR1/USR2/QUIT to the rank."""
        with self._lock:
            if self.returncode is not None or self._pidfd < 0:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited, not reaped yet

    def kill(self) -> None:
        """SIGKILL the init; the kernel then kills everything in its PID namespace."""
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Release the pidfd and the pipe ends never handed over (the process is untouched;
        call after wait())."""
        self.io.close()
        with self._lock:
            pidfd, self._pidfd = self._pidfd, -1
        if pidfd >= 0:
            os.close(pidfd)

    def kill_and_reap(self, timeout: float = 30.0) -> None:
        """End the sandbox and release everything it holds (a launch or restore that failed)."""
        self.kill()
        if self.wait(timeout) is None:
            log.error("sandbox init %d did not exit within %.0fs of SIGKILL", self.pid, timeout)
        self.close()


def become_subreaper() -> None:
    """Make this process adopt orphaned descendants (the sandbox inits).

    Raises:
        SandboxError: the kernel refused prctl(PR_SET_CHILD_SUBREAPER).
    """
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise SandboxError(
            f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}",
            "run the agent on Linux >= 3.4",
        )


def die_with_parent(parent: int) -> None:
    """Be killed when `parent` ends (PR_SET_PDEATHSIG), as a child started by it calls between
    fork and exec: a keeper killed outright takes its agent along (a lost node, not a restart).
    """
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before the prctl took hold
        os._exit(1)


def is_subreaper() -> bool:
    flag = ctypes.c_int(0)
    if _libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) != 0:
        return False
    return bool(flag.value)


def netns_path(netns: str) -> Path:
    """`NAME` -> /run/netns/NAME (what `ip netns add` makes); a path is taken as is.

    Raises:
        SandboxError: no such namespace file.
    """
    path = Path(netns) if "/" in netns else Path("/run/netns") / netns
    if not path.exists():
        raise SandboxError(
            f"network namespace {netns!r} not found at {path}",
            f"create it (ip netns add {netns}) before starting ranks in it",
        )
    return path


def new_pipes() -> tuple[RankIO, dict[str, int]]:
    """Make the four rank pipes; return the agent side and the rank side (name -> fd)."""
    agent: dict[str, int] = {}
    rank: dict[str, int] = {}
    inodes: dict[str, int] = {}
    try:
        for name in PIPE_NAMES:
            r, w = os.pipe2(os.O_CLOEXEC)
            agent[name], rank[name] = (w, r) if name == "ctl_in" else (r, w)
            inodes[name] = os.fstat(r).st_ino
    except OSError:
        for fd in (*agent.values(), *rank.values()):
            os.close(fd)
        raise
    return RankIO(agent, inodes), rank


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    *,
    init_cwd: Path,
    netns: str | None = None,
    private_tmp: Path | None = None,
    timeout: float = SPAWN_TIMEOUT_S,
) -> Sandbox:
    """Start `argv` as the rank of a new sandbox and return it once the init is our child.

    `init_cwd` is the init's private working directory (created if missing); give every
    sandbox its own. The caller sets the rank's environment in full, including
    SNAPSHOTTER_CTL_IN=3 / SNAPSHOTTER_CTL_OUT=4, except TMPDIR: with `private_tmp` the
    sandbox gets its own mount namespace with a fresh tmpfs on that directory
    (created on the host if missing, never written to) and TMPDIR points there. None (the
    default) keeps the host's mount namespace and the caller's TMPDIR: a restore then needs no
    particular mount layout on the target node, which `private_tmp` does (every host mount the
    sandbox saw, at the same path). Neither `init_cwd`, `cwd`, nor the
    snapinit binary may lie under `private_tmp`.

    Waits at most `timeout` seconds. Whatever fails, nothing it started keeps running: the
    init starts the rank only after its pid reached us (csrc/snapinit.c).

    Raises:
        SandboxError: the caller is not a child subreaper, the init could not be built or
            started or did not report in time, or the network namespace does not exist.
    """
    if not is_subreaper():
        raise SandboxError(
            "spawn() needs a child subreaper: the sandbox init is re-parented to its caller",
            "call snapshotter.sandbox.spawn.become_subreaper() once at agent start",
        )
    init_cwd.mkdir(parents=True, exist_ok=True)
    cmd = [str(snapinit_path())]
    if private_tmp is not None:
        private_tmp.mkdir(mode=0o755, parents=True, exist_ok=True)
        cmd += ["--private-tmp", str(private_tmp)]
    if netns is not None:
        cmd += ["--netns", str(netns_path(netns))]
    deadline = time.monotonic() + timeout
    with children.spawning():
        io, rank = new_pipes()
        try:
            pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
        except OSError:
            io.close()
            for fd in rank.values():
                os.close(fd)
            raise
        try:
            cmd += [
                "--pid-fd", str(pid_w),
                "--init-cwd", str(init_cwd),
                "--fd", f"{rank['ctl_in']}:{RANK_CTL_IN_FD}",
                "--fd", f"{rank['ctl_out']}:{RANK_CTL_OUT_FD}",
                "--", *argv,
            ]  # fmt: skip
            try:
                outer = children.popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=rank["stdout"],
                    stderr=rank["stderr"],
                    pass_fds=(pid_w, rank["ctl_in"], rank["ctl_out"]),
                    env=dict(env),
                    cwd=cwd,
                    close_fds=True,
                )
            except OSError as e:
                raise SandboxError(f"cannot start {cmd[0]}: {e}", "check the rank's cwd") from e
            finally:
                for fd in (pid_w, *rank.values()):
                    os.close(fd)
            text, rc = _await_pid(outer, pid_r, deadline)
        except BaseException:
            io.close()
            raise
        finally:
            os.close(pid_r)
        if rc != 0 or not text.isdigit():
            detail = _drain(io.stderr)
            io.close()
            if rc is None:
                raise SandboxError(
                    f"snapinit did not report the sandbox's pid within {timeout:.0f}s "
                    f"(killed it; no rank was started): {detail or 'no output'}",
                    "the node may be overloaded; retry, and check the agent's log",
                )
            raise SandboxError(
                f"snapinit failed to start the sandbox (exit {rc}): {detail or 'no output'}",
                "check argv, cwd and the network namespace",
            )
        # The outer snapinit has exited and been reaped: the init is re-parented to us, and
        # owned from here on (a reaper must not take its status).
        return Sandbox(int(text), io)


def _await_pid(
    outer: subprocess.Popen[bytes], pid_r: int, deadline: float
) -> tuple[str, int | None]:
    """The init's pid as snapinit wrote it, and snapinit's exit code (None: it was killed
    at the deadline). The pipe reaches EOF once snapinit exits: nothing else holds its write
    end (snapinit closes every descriptor it was not asked to keep)."""
    data = b""
    poller = select.poll()
    poller.register(pid_r, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(max(1, int(left * 1000))):
            outer.kill()
            outer.wait()
            return data.decode(errors="replace").strip(), None
        chunk = os.read(pid_r, 64)
        if not chunk:
            break
        data += chunk
    try:
        rc = outer.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        outer.kill()
        outer.wait()
        return data.decode(errors="replace").strip(), None
    return data.decode(errors="replace").strip(), rc


def _drain(fd: int) -> str:
    """Whatever is already in a pipe, without blocking (for error messages)."""
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace").strip()
