"""The job's rendezvous store, hosted by the agent outside the rank sandboxes.

It runs torch's TCPStore server in a helper process started with the job's own Python (the
agent itself never imports torch). Because it lives outside the ranks, it is never dumped, and
a thaw simply starts a new one and tells the ranks its address.
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
from snapshotter.launch.env import StoreAddress
from snapshotter.sandbox import children


class StoreServer:
    """Starts at construction; `address` waits for the server to report its port, so the
    start overlaps whatever the caller does meanwhile (CRIU restores, on a thaw)."""

    def __init__(self, python: str, host: str, env: Mapping[str, str], timeout: float = 60.0):
        self.host = host
        self._python = python
        self._timeout = timeout
        self._started = time.monotonic()
        self._address: StoreAddress | None = None
        self._lock = threading.Lock()
        self._proc = children.popen(
            [python, "-m", "snapshotter.hook.store_server", "--host", host, "--port", "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(env),
            start_new_session=True,
        )

    @property
    def address(self) -> StoreAddress:
        """Raises: ServiceUnavailable if the server did not report its port in time."""
        with self._lock:
            if self._address is None:
                self._address = self._await_port()
            return self._address

    def _await_port(self) -> StoreAddress:
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
                    f"the job's store server did not start with {self._python}: {err}",
                    "check that this Python has torch installed (the job's own dependency)",
                )
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    continue
                line += chunk
        info = json.loads(line.decode().strip().splitlines()[-1])
        return StoreAddress(host=str(info["host"]), port=int(info["port"]))

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
