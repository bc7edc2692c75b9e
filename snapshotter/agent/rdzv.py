"""The job's rendezvous server (a c10d TCPStore), hosted by the agent outside the sandboxes.

It runs in a helper process started with the job's own Python (the agent itself never imports
torch). Living outside the ranks, it is never dumped: a thaw simply starts a new one and tells
the ranks its address. `RdzvHost` keeps the servers opened for jobs about to launch or thaw
with this node as node 0, until a launch or restore claims them (or they expire: the
coordinator that opened one died before using it).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.agent import retention
from snapshotter.launch.env import RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.sandbox import children


class RdzvServer:
    """Starts at construction; `address` waits for the server to report its port, so the
    start overlaps whatever the caller does meanwhile (CRIU restores, on a thaw).

    `standby`: the process imports torch and waits; `listen` then makes it serve (a spare
    kept ready, so that the next thaw does not wait for the import)."""

    def __init__(
        self, python: str, host: str, env: Mapping[str, str], timeout: float = 60.0,
        port: int = 0, standby: bool = False,
    ) -> None:  # fmt: skip
        self.host = host
        self._python = python
        self._timeout = timeout
        self._started = time.monotonic()
        self._address: RdzvAddress | None = None
        self._lock = threading.Lock()
        where = ["--standby"] if standby else ["--host", host, "--port", str(port)]
        self._proc = children.popen(
            [python, "-m", "snapshotter.hook.rdzv_server", *where],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
        )

    def listen(self, host: str, port: int = 0) -> None:
        """A standby server starts listening (its `address` then reports where)."""
        assert self._proc.stdin is not None
        self.host = host
        self._started = time.monotonic()
        try:
            self._proc.stdin.write(json.dumps({"host": host, "port": port}).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            pass  # it died: `address` reports why

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def address(self) -> RdzvAddress:
        """Raises: ServiceUnavailable if the server did not report its port in time."""
        with self._lock:
            if self._address is None:
                self._address = self._await_port()
            return self._address

    def _await_port(self) -> RdzvAddress:
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = self._started + self._timeout
        buf = b""
        while True:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                info = json.loads(line.decode().strip() or "{}")
                if "port" in info:  # (a standby server reports "ready" first)
                    return RdzvAddress(host=str(info["host"]), port=int(info["port"]))
            left = deadline - time.monotonic()
            if left <= 0 or self._proc.poll() is not None:
                err = self._stderr_tail()
                self.stop()
                raise errors.ServiceUnavailable(
                    f"the job's rendezvous server did not start with {self._python}: {err}",
                    "check that this Python has torch installed (the job's own dependency)",
                )
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                buf += os.read(fd, 4096)

    def _stderr_tail(self) -> str:
        if self._proc.poll() is None or self._proc.stderr is None:
            return "timed out"
        return self._proc.stderr.read().decode(errors="replace")[-2000:]

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        for f in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if f is not None:
                f.close()


_IMPORT_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "VIRTUAL_ENV")


def _imports(env: Mapping[str, str]) -> dict[str, str | None]:
    return {k: env.get(k) for k in _IMPORT_ENV}


@dataclass
class _Spare:
    server: RdzvServer
    python: str
    env: dict[str, str]
    seen: float  # when its job last ran here, or the spare was made (monotonic)


class RdzvHost:
    """Rendezvous servers opened here ahead of a launch or thaw, by job id, and spares kept
    ready for the next thaw of jobs that recover by themselves (at most `max_spares`, the
    newest jobs': each is a Python that imported torch)."""

    def __init__(self, host: str, max_spares: int = 0) -> None:
        self.host = host
        self.max_spares = max_spares
        self._lock = threading.Lock()
        self._servers: dict[str, RdzvServer] = {}
        self._opened: dict[str, float] = {}
        self._spares: dict[str, _Spare] = {}

    def open(
        self, job_id: str, python: str, env: Mapping[str, str], spare: bool = False
    ) -> RdzvAddress:
        """Start one (replacing an older one for the same job) and return its address; with
        `spare`, start a standby one for the job's next thaw here too.

        Raises: ServiceUnavailable if it does not start.
        """
        server = self._take_spare(job_id, python, env)
        if server is not None:
            server.listen(self.host)
        else:
            server = RdzvServer(python, self.host, env)
        if spare:
            self._keep_spare(job_id, python, env)
        try:
            addr = server.address
        except BaseException:
            server.stop()
            raise
        with self._lock:
            old = self._servers.pop(job_id, None)
            self._servers[job_id] = server
            self._opened[job_id] = time.monotonic()
        if old is not None:
            old.stop()
        return addr

    def _take_spare(self, job_id: str, python: str, env: Mapping[str, str]) -> RdzvServer | None:
        with self._lock:
            sp = self._spares.pop(job_id, None)
        if sp is None:
            return None
        # The same interpreter and import path (a thaw's spec leaves out what a snapshot must
        # not keep, such as secrets, which a store server does not read).
        if sp.python == python and _imports(sp.env) == _imports(env) and sp.server.alive():
            return sp.server
        sp.server.stop()
        return None

    def _keep_spare(self, job_id: str, python: str, env: Mapping[str, str]) -> None:
        if self.max_spares <= 0:
            return
        with self._lock:
            if job_id in self._spares:
                return
            out = sorted(self._spares, key=lambda j: self._spares[j].seen)
            evicted = [self._spares.pop(j) for j in out[: max(0, len(out) + 1 - self.max_spares)]]
            self._spares[job_id] = _Spare(
                RdzvServer(python, self.host, env, standby=True), python, dict(env),
                time.monotonic(),
            )  # fmt: skip
        for sp in evicted:
            sp.server.stop()

    def expire_spares(self, running: set[str], idle_s: float) -> list[str]:
        """Stop the spares of jobs that have not run here for `idle_s` (or died); return
        their jobs."""
        now = time.monotonic()
        with self._lock:
            for j, sp in self._spares.items():
                if j in running:
                    sp.seen = now
            stale = [j for j, sp in self._spares.items()
                     if now - sp.seen > idle_s or not sp.server.alive()]  # fmt: skip
            spares = [self._spares.pop(j) for j in stale]
        for sp in spares:
            sp.server.stop()
        return stale

    def spares(self) -> list[str]:
        with self._lock:
            return sorted(self._spares)

    def close(self, job_id: str) -> None:
        with self._lock:
            server = self._servers.pop(job_id, None)
            self._opened.pop(job_id, None)
        if server is not None:
            server.stop()

    def claim(
        self, spec: JobSpec, remote: RdzvAddress | None
    ) -> tuple[RdzvServer | None, RdzvAddress | None]:
        """The job's server on this node: the one opened for it here (node 0, which then owns
        it), a new one when none is named (a caller driving one node alone), or just node 0's
        address."""
        with self._lock:
            opened = self._servers.pop(spec.job_id, None)
            self._opened.pop(spec.job_id, None)
        if opened is not None:
            return opened, None
        if remote is None:
            return RdzvServer(spec.python, self.host, spec.env), None
        return None, remote

    def expire(self, ttl_s: float) -> list[str]:
        """Stop servers no launch or thaw claimed within `ttl_s`; return their jobs."""
        with self._lock:
            stale = retention.expired(self._opened, time.monotonic(), ttl_s)
            servers = [self._servers.pop(j) for j in stale if j in self._servers]
            for j in stale:
                self._opened.pop(j, None)
        for server in servers:
            server.stop()
        return stale

    def stop_all(self) -> None:
        with self._lock:
            servers = list(self._servers.values()) + [sp.server for sp in self._spares.values()]
            self._servers.clear()
            self._opened.clear()
            self._spares.clear()
        for server in servers:
            server.stop()
