"""The keeper: a small process between the service manager and the agent, so that an agent
crash or restart never costs a job its ranks (what a container runtime's shim does for its
containers through a daemon restart).

    keeper (subreaper) -> agent process (the embedded daemon) -> rank sandboxes

- It starts the agent and starts it again when it dies (not when it exits 0: a clean stop).
  SIGHUP restarts it at once (an upgrade: the new agent re-adopts every rank). SIGTERM is
  passed on (the agent drains its node, then both stop). A keeper killed outright takes the
  agent with it (PR_SET_PDEATHSIG): that is the node's agent lost, not a restart.
- It holds the agent's ends of every rank's pipes, handed to it over a unix socket with
  SCM_RIGHTS: the ranks' control channels stay open and their output keeps flowing into
  their log files while no agent runs.
- Sandboxes the dead agent left are reparented to it (the nearest subreaper): it reaps them
  and keeps their exit status for the agent that comes next.
- A new agent lists what it holds, takes the control channels back (dups) and re-adopts the
  sandboxes; it releases an entry once that sandbox has ended.

Requests are one JSON object per SOCK_SEQPACKET message (fds ride along), answered with one:

    {"op":"hold","key":K,"pid":P,"start":S,"meta":{...},"log":PATH}
        + fds [stdout, stderr, ctl_in, ctl_out]                      -> {"ok":true}
    {"op":"list"}                          -> {"ok":true,"held":[{key,pid,start,meta,exit}]}
    {"op":"fetch","key":K}                 -> {"ok":true} + fds [ctl_in, ctl_out]
    {"op":"release","key":K}               -> {"ok":true}
    {"op":"respec","job_id":J,"job":{...}} -> {"ok":true,"changed":N}  (meta.job of J's ranks)
    {"op":"rerdzv","job_id":J,"remote_rdzv":[H,P]} -> {"ok":true,"changed":N}
                                           (where J's rendezvous server is now: it moved)

It imports nothing but the standard library, snapshotter.sandbox.spawn's subreaper call and
snapshotter.servicelog (stdlib only):
it must stay small, and it is never upgraded while jobs run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter import servicelog

log = logging.getLogger("snapshotter.keeper")
ENV = "SNAPSHOTTER_KEEPER"  # the socket's path, for the agent it starts
FD_NAMES = ("stdout", "stderr", "ctl_in", "ctl_out")
MAX_MSG = 1 << 20
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
# An agent that fails this soon after starting, with no rank to keep, has a cause a restart
# will not fix (a bad store URL, a busy socket): the keeper exits with its status instead.
EARLY_EXIT_S = 10.0


def alive(sock_path: Path) -> bool:
    """Whether a keeper answers at `sock_path` (an empty message is its liveness probe)."""
    if not sock_path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(sock_path))
        except OSError:
            return False
    return True


def command(sock_path: Path, agent_argv: list[str]) -> list[str]:
    """The command line that runs `agent_argv` under a keeper listening at `sock_path`."""
    return [sys.executable, "-m", "snapshotter.keeper", "--socket", str(sock_path), "--",
            *agent_argv]  # fmt: skip


@dataclass
class Held:
    key: str
    pid: int
    start: str
    meta: dict[str, Any]
    fds: dict[str, int]
    logf: Any = None
    open_streams: set[int] = field(default_factory=set)
    released: bool = False


class Keeper:
    def __init__(self, sock_path: Path, argv: list[str]) -> None:
        self.sock_path = sock_path
        self.argv = argv
        self.held: dict[str, Held] = {}
        self.exits: dict[int, int] = {}  # sandbox init pid -> exit status (we reaped it)
        self.agent: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.reloading = False
        self.restarts: list[float] = []
        self.started = 0.0
        self.sel = selectors.DefaultSelector()

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        from snapshotter.sandbox.spawn import become_subreaper

        become_subreaper()
        self.sock_path.parent.mkdir(parents=True, exist_ok=True)
        self.sock_path.unlink(missing_ok=True)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        srv.bind(str(self.sock_path))
        os.chmod(self.sock_path, 0o600)
        srv.listen(16)
        srv.setblocking(False)
        self.sel.register(srv, selectors.EVENT_READ, ("accept", None))
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self._stop(signal.SIGTERM))
        signal.signal(signal.SIGINT, lambda *_: self._stop(signal.SIGINT))
        signal.signal(signal.SIGHUP, lambda *_: self._reload())
        self.sel.register(wake_r, selectors.EVENT_READ, ("wake", None))
        self._spawn()
        code = 0
        try:
            while True:
                for key, _ in self.sel.select(timeout=1.0):
                    kind, obj = key.data
                    if kind == "accept":
                        self._accept(srv)
                    elif kind == "wake":
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_r, 4096)
                    elif kind == "stream":
                        self._pump(key.fd, obj)
                done = self._reap()
                if done is not None:
                    code = done
                    break
        finally:
            srv.close()
            self.sock_path.unlink(missing_ok=True)
            for h in list(self.held.values()):
                self._drop(h)
        return code

    def _stop(self, sig: int) -> None:
        self.stopping = True
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(sig)

    def _reload(self) -> None:
        """Restart the agent now, without draining (SIGHUP: the agent stops, keeping its ranks
        running, and the next one re-adopts them)."""
        if self.agent is not None and self.agent.poll() is None and not self.stopping:
            self.reloading = True
            self.agent.send_signal(signal.SIGHUP)

    def _spawn(self) -> None:
        from snapshotter.sandbox.spawn import die_with_parent

        env = dict(os.environ)
        env[ENV] = str(self.sock_path)
        me = os.getpid()
        self.agent = subprocess.Popen(  # noqa: S603 - our own daemon
            self.argv, env=env, preexec_fn=lambda: die_with_parent(me)
        )
        self.started = time.monotonic()
        log.info("keeper %d started agent %d", os.getpid(), self.agent.pid)

    def _reap(self) -> int | None:
        """Reap every exited child. Returns the keeper's exit code once it should stop."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return None
            if pid == 0:
                return None
            code = os.waitstatus_to_exitcode(status)
            if self.agent is not None and pid == self.agent.pid:
                self.agent.returncode = code
                if self.stopping and code in (0, -signal.SIGTERM, -signal.SIGINT):
                    return 0  # it stopped as we asked
                if self.reloading and not self.stopping:
                    self.reloading = False
                    log.info("agent %d stopped for a reload (%s); starting the new one", pid, code)
                    self._spawn()
                    continue
                if self.stopping or code == 0:
                    return code if code >= 0 else 128 - code
                if time.monotonic() - self.started < EARLY_EXIT_S and not self.held:
                    log.error("agent exited %s right after it started; not restarting it", code)
                    return code if code >= 0 else 128 - code
                self._restart(code)
            else:
                self.exits[pid] = code

    def _restart(self, code: int) -> None:
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < 300] + [now]
        delay = RESTART_BACKOFF_S[min(len(self.restarts), len(RESTART_BACKOFF_S)) - 1]
        log.warning("agent exited %s; starting it again in %.1fs (it re-adopts %d rank(s))",
                    code, delay, len(self.held))  # fmt: skip
        time.sleep(delay)
        self._spawn()

    # ---- requests --------------------------------------------------------------------------

    def _accept(self, srv: socket.socket) -> None:
        try:
            conn, _ = srv.accept()
        except BlockingIOError:
            return
        with conn:
            conn.settimeout(5.0)
            try:
                data, fds, _, _ = socket.recv_fds(conn, MAX_MSG, len(FD_NAMES))
                if not data and not fds:
                    return  # a liveness probe (the CLI asking whether a keeper runs)
                reply, out_fds = self._handle(json.loads(data), fds)
            except (OSError, ValueError, KeyError, TypeError) as e:
                reply, out_fds = {"ok": False, "error": f"{type(e).__name__}: {e}"}, []
            try:
                socket.send_fds(conn, [json.dumps(reply).encode()], out_fds)
            except OSError as e:
                log.warning("keeper could not answer: %s", e)
            finally:
                for fd in out_fds:
                    os.close(fd)

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = msg.get("op")
        if op == "hold":
            if len(fds) != len(FD_NAMES):
                for fd in fds:
                    os.close(fd)
                raise ValueError(f"hold needs {len(FD_NAMES)} fds, got {len(fds)}")
            self._hold(msg, dict(zip(FD_NAMES, fds, strict=True)))
            return {"ok": True}, []
        if op == "list":
            held = [
                {"key": h.key, "pid": h.pid, "start": h.start, "meta": h.meta,
                 "exit": self.exits.get(h.pid)}
                for h in self.held.values() if not h.released
            ]  # fmt: skip
            return {"ok": True, "held": held}, []
        if op == "fetch":
            h = self.held[str(msg["key"])]
            return {"ok": True}, [os.dup(h.fds["ctl_in"]), os.dup(h.fds["ctl_out"])]
        if op == "respec":  # the job's spec changed (a policy set after launch)
            job_id = str(msg["job_id"])
            mine = [h for h in self.held.values()
                    if not h.released and h.meta.get("job", {}).get("job_id") == job_id]
            for h in mine:
                h.meta["job"] = dict(msg["job"])
            return {"ok": True, "changed": len(mine)}, []
        if op == "rerdzv":  # the job's rendezvous server moved (node 0 migrated)
            job_id = str(msg["job_id"])
            mine = [h for h in self.held.values()
                    if not h.released and h.meta.get("job", {}).get("job_id") == job_id]
            for h in mine:
                h.meta["remote_rdzv"] = list(msg["remote_rdzv"])
                h.meta["rdzv_port"] = None
            return {"ok": True, "changed": len(mine)}, []
        if op == "release":
            gone = self.held.get(str(msg["key"]))
            if gone is not None:
                gone.released = True
                self._close_ctl(gone)
                self.exits.pop(gone.pid, None)
                if not gone.open_streams:
                    self._drop(gone)
            return {"ok": True}, []
        raise ValueError(f"unknown op {op!r}")

    def _hold(self, msg: dict[str, Any], fds: dict[str, int]) -> None:
        key = str(msg["key"])
        old = self.held.pop(key, None)
        if old is not None:
            self._drop(old)
        h = Held(key=key, pid=int(msg["pid"]), start=str(msg["start"]), meta=dict(msg["meta"]),
                 fds=fds)  # fmt: skip
        h.logf = open(msg["log"], "ab", buffering=0)  # noqa: SIM115 - closed in _drop
        for name in ("stdout", "stderr"):
            os.set_blocking(fds[name], False)
            self.sel.register(fds[name], selectors.EVENT_READ, ("stream", h))
            h.open_streams.add(fds[name])
        self.held[key] = h

    def _pump(self, fd: int, h: Held) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            with contextlib.suppress(OSError):
                h.logf.write(data)
            return
        self.sel.unregister(fd)
        os.close(fd)
        h.open_streams.discard(fd)
        h.fds = {n: f for n, f in h.fds.items() if f != fd}
        if h.released and not h.open_streams:
            self._drop(h)

    def _close_ctl(self, h: Held) -> None:
        for name in ("ctl_in", "ctl_out"):
            fd = h.fds.pop(name, None)
            if fd is not None:
                os.close(fd)

    def _drop(self, h: Held) -> None:
        for fd in list(h.open_streams):
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(fd)
            os.close(fd)
        h.open_streams.clear()
        self._close_ctl(h)
        h.fds = {}
        if h.logf is not None:
            h.logf.close()
        self.held.pop(h.key, None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snapshotter-keeper")
    ap.add_argument("--socket", required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- the agent's command line")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the agent's command after --")
    servicelog.setup()
    return Keeper(Path(a.socket), cmd).run()


if __name__ == "__main__":
    sys.exit(main())
