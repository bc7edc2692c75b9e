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

from snapshotter import errors
from snapshotter.agent import retention
from snapshotter.launch.env import RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.sandbox import children


class RdzvServer:
    """Starts at construction; `address` waits for the server to report its port, so the
    start overlaps whatever the caller does meanwhile (CRIU restores, on a thaw)."""

    def __init__(
        self, python: str, host: str, env: Mapping[str, str], timeout: float = 60.0,
        port: int = 0,
    ) -> None:  # fmt: skip
        self.host = host
        self._python = python
        self._timeout = timeout
        self._started = time.monotonic()
        self._address: RdzvAddress | None = None
        self._lock = threading.Lock()
        self._proc = children.popen(
            [python, "-m", "snapshotter.hook.rdzv_server", "--host", host, "--port", str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
        )

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
        line = b""
        while not line.endswith(b"\n"):
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
                chunk = os.read(fd, 4096)
                if not chunk:
                    continue
                line += chunk
        info = json.loads(line.decode().strip().splitlines()[-1])
        return RdzvAddress(host=str(info["host"]), port=int(info["port"]))

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


class RdzvHost:
    """Rendezvous servers opened here ahead of a launch or thaw, by job id."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._servers: dict[str, RdzvServer] = {}
        self._opened: dict[str, float] = {}

    def open(self, job_id: str, python: str, env: Mapping[str, str]) -> RdzvAddress:
        """Start one (replacing an older one for the same job) and return its address.

        Raises: ServiceUnavailable if it does not start.
        """
        server = RdzvServer(python, self.host, env)
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
            servers = list(self._servers.values())
            self._servers.clear()
            self._opened.clear()
        for server in servers:
            server.stop()
