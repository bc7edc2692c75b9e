"""The agent's side of its keeper (snapshotter/keeper.py): hand over each sandbox's pipes,
and, after a restart, take the sandboxes back (`readopt`).

Without a keeper (an agent embedded in a test, or started without one) the agent pumps its
ranks' output itself and a restart ends whatever its previous incarnation left (orphans.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.agent.orphans import start_time
from snapshotter.keeper import ENV, FD_NAMES, MAX_MSG
from snapshotter.launch.env import RankPlacement
from snapshotter.sandbox.spawn import RankIO, Sandbox

log = logging.getLogger(__name__)


class KeeperClient:
    def __init__(self, path: str) -> None:
        self.path = path

    def _call(
        self, msg: dict[str, Any], fds: Sequence[int] = ()
    ) -> tuple[dict[str, Any], list[int]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10.0)
            try:
                s.connect(self.path)
                socket.send_fds(s, [json.dumps(msg).encode()], list(fds))
                data, got, _, _ = socket.recv_fds(s, MAX_MSG, len(FD_NAMES))
            except OSError as e:
                raise errors.ServiceUnavailable(
                    f"the agent's keeper at {self.path} does not answer ({e})",
                    "restart the agent's service (its ranks may have to be thawed)",
                ) from e
        reply: dict[str, Any] = json.loads(data or b"{}")
        if not reply.get("ok"):
            for fd in got:
                os.close(fd)
            raise errors.Internal(f"the keeper refused {msg.get('op')}: {reply.get('error')}",
                                  "see the daemon log")  # fmt: skip
        return reply, got

    def hold(self, key: str, pid: int, meta: dict[str, Any], log_path: Path,
             fds: Sequence[int]) -> None:  # fmt: skip
        msg = {"op": "hold", "key": key, "pid": pid, "start": start_time(pid) or "",
               "meta": meta, "log": str(log_path)}  # fmt: skip
        self._call(msg, fds)

    def held(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = self._call({"op": "list"})[0]["held"]
        return entries

    def fetch(self, key: str) -> tuple[int, int]:
        _, fds = self._call({"op": "fetch", "key": key})
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            raise errors.Internal(f"the keeper gave {len(fds)} fds for {key}", "see the log")
        return fds[0], fds[1]

    def respec(self, job_id: str, spec: dict[str, Any]) -> int:
        """The spec a restarted agent re-adopts `job_id` with; how many ranks it changed."""
        return int(self._call({"op": "respec", "job_id": job_id, "job": spec})[0]["changed"])

    def rerdzv(self, job_id: str, host: str, port: int) -> int:
        """Where a restarted agent's re-adopted ranks of `job_id` find its rendezvous server
        now (node 0 moved); how many ranks it changed."""
        msg = {"op": "rerdzv", "job_id": job_id, "remote_rdzv": [host, port]}
        return int(self._call(msg)[0]["changed"])

    def release(self, key: str) -> None:
        with contextlib.suppress(errors.SnapshotterError):
            self._call({"op": "release", "key": key})

    def exit_code(self, pid: int) -> int | None:
        for e in self.held():
            if e["pid"] == pid:
                code = e.get("exit")
                return None if code is None else int(code)
        return None


def from_env() -> KeeperClient | None:
    path = os.environ.get(ENV)
    return KeeperClient(path) if path else None


def meta_of(
    spec: dict[str, Any], node_rank: int, p: RankPlacement, init_cwd: str,
    remote: tuple[str, int] | None, inodes: Mapping[str, int], rdzv_port: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """What a restarted agent needs to rebuild a rank (kept by the keeper, in memory only):
    the pipes' inodes too, which a dump names as the rank's external pipes, and on node 0 the
    port of the job's rendezvous server, which the next agent listens on again (the other
    nodes' ranks know only that address)."""
    return {"job": spec, "node_rank": node_rank, "placement": asdict(p), "init_cwd": init_cwd,
            "remote_rdzv": list(remote) if remote else None, "inodes": dict(inodes),
            "rdzv_port": rdzv_port}  # fmt: skip


class AdoptedSandbox(Sandbox):
    """A sandbox a previous incarnation of this agent started: not our child (the keeper is
    its parent now), so its end is seen on a pidfd and its exit status comes from the keeper."""

    def __init__(
        self, pid: int, keeper: KeeperClient, inodes: Mapping[str, int], start: str = ""
    ) -> None:
        self.pid = pid
        self.io = RankIO({}, inodes)
        self.returncode: int | None = None
        self._keeper = keeper
        self._lock = threading.Lock()
        try:
            self._pidfd = os.pidfd_open(pid)
            if start and start_time(pid) != start:
                os.close(self._pidfd)
                raise ProcessLookupError(pid)  # ended, and its pid taken by another process
        except ProcessLookupError:
            # It ended while no agent ran (killed with it, say): the job is re-adopted with
            # this rank already ended, so its failure is seen and handled like any other.
            self._pidfd = -1
            self.returncode = self._reap()

    def _reap(self) -> int:
        # The keeper reaps it on SIGCHLD: give it a moment to record the status.
        code = None
        for _ in range(50):
            try:
                code = self._keeper.exit_code(self.pid)
            except errors.SnapshotterError:
                break
            if code is not None:
                break
            time.sleep(0.1)
        return code if code is not None else 1
