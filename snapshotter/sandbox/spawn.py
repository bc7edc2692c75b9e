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

This module never calls waitpid(-1) (it would steal other children's statuses), and never
uses `ip netns exec`: its mount namespace shares mounts with the host, which CRIU cannot dump.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from snapshotter.errors import SandboxError
from snapshotter.sandbox.initbin import snapinit_path

PIPE_NAMES = ("stdout", "stderr", "ctl_in", "ctl_out")
RANK_CTL_IN_FD = 3
RANK_CTL_OUT_FD = 4
# The mountpoint of each sandbox's private tmpfs (an empty host directory, shared by all
# sandboxes as a mountpoint only). A fixed path: a restore must find the same one.
PRIVATE_TMP = Path("/tmp/snapshotter-private-tmp")

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class RankIO:
    """The agent's ends of a rank's pipes (all O_CLOEXEC) and the pipes' inodes.

    stdout/stderr/ctl_out are read ends, ctl_in is a write end. `inodes` maps each name in
    PIPE_NAMES to the pipe's inode, the `N` in CRIU's `pipe:[N]`.
    """

    stdout: int
    stderr: int
    ctl_in: int
    ctl_out: int
    inodes: Mapping[str, int]

    def close(self) -> None:
        for fd in (self.stdout, self.stderr, self.ctl_in, self.ctl_out):
            try:
                os.close(fd)
            except OSError:
                pass


class Sandbox:
    """A running sandbox seen from its parent: the init's host pid and the rank's pipes."""

    def __init__(self, pid: int, io: RankIO) -> None:
        self.pid = pid
        self.io = io
        self.returncode: int | None = None
        self._lock = threading.Lock()
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
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)  # readable once the init has exited
            if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
                return None
            with self._lock:
                if self.returncode is None:
                    _, status = os.waitpid(self.pid, 0)
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self.wait(timeout=0)

    def send_signal(self, sig: int) -> None:
        """Signal the init, which forwards TERM/INT/HUP/USR1/USR2/QUIT to the rank."""
        if self.returncode is None and self._pidfd >= 0:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # exited, not reaped yet

    def kill(self) -> None:
        """SIGKILL the init; the kernel then kills everything in its PID namespace."""
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Close the agent's pipe ends and the pidfd (after wait(); the process is untouched)."""
        self.io.close()
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1


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
    return RankIO(inodes=inodes, **agent), rank


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    *,
    init_cwd: Path,
    netns: str | None = None,
    private_tmp: Path | None = None,
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

    Raises:
        SandboxError: the caller is not a child subreaper, the init could not be built or
            started, or the network namespace does not exist.
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
    io, rank = new_pipes()
    pid_r, pid_w = os.pipe2(os.O_CLOEXEC)
    try:
        cmd += [
            "--pid-fd", str(pid_w),
            "--init-cwd", str(init_cwd),
            "--fd", f"{rank['ctl_in']}:{RANK_CTL_IN_FD}",
            "--fd", f"{rank['ctl_out']}:{RANK_CTL_OUT_FD}",
            "--", *argv,
        ]  # fmt: skip
        try:
            outer = subprocess.Popen(
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
        # The outer snapinit exits right after writing the pid; once it is reaped the init
        # has been re-parented to us and os.waitpid(init) works.
        rc = outer.wait()
        with os.fdopen(pid_r, "rb", closefd=False) as f:
            text = f.read().decode(errors="replace").strip()
    except BaseException:
        io.close()
        raise
    finally:
        os.close(pid_r)
    if rc != 0 or not text.isdigit():
        detail = _drain(io.stderr)
        io.close()
        raise SandboxError(
            f"snapinit failed to start the sandbox (exit {rc}): {detail or 'no output'}",
            "check argv, cwd and the network namespace",
        )
    return Sandbox(int(text), io)


def _drain(fd: int) -> str:
    """Whatever is already in a pipe, without blocking (for error messages)."""
    chunks = []
    while select.select([fd], [], [], 0)[0]:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace").strip()
