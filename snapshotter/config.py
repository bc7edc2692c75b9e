"""Where snapshotter keeps its state on a node, and the settings read from the environment.

SNAPSHOTTER_HOME     state directory (default /var/lib/snapshotter as root, else
                     ~/.local/state/snapshotter)
SNAPSHOTTER_STORE    snapshot storage URL: a directory path, file:///path or s3://bucket/prefix
                     (S3 endpoint and credentials the AWS way: AWS_ENDPOINT_URL, AWS_* keys)
SNAPSHOTTER_COORDINATOR  host:port of a remote coordinator; unset = the embedded local one
SNAPSHOTTER_PRIVATE_TMP  1 (default): each rank sandbox has its own TMPDIR (a tmpfs dumped with
                     it); 0: ranks share the node's /tmp and keep the caller's TMPDIR
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def default_home() -> Path:
    env = os.environ.get("SNAPSHOTTER_HOME")
    if env:
        return Path(env).resolve()
    if os.geteuid() == 0:
        return Path("/var/lib/snapshotter")
    return Path.home() / ".local" / "state" / "snapshotter"


@dataclass(frozen=True)
class Paths:
    home: Path

    @property
    def daemon_file(self) -> Path:
        return self.home / "daemon.json"

    @property
    def daemon_log(self) -> Path:
        return self.home / "daemon.log"

    @property
    def default_store(self) -> str:
        return str(self.home / "store")

    def job_dir(self, job_id: str) -> Path:
        return self.home / "jobs" / job_id

    def log_file(self, job_id: str, rank: int) -> Path:
        return self.job_dir(job_id) / "logs" / f"rank-{rank}.log"

    def work_dir(self, op_id: str) -> Path:
        return self.home / "work" / op_id

    def init_cwd(self, sandbox_id: str) -> Path:
        return self.home / "sandbox" / sandbox_id

    def criu_logs(self, op_id: str) -> Path:
        return self.home / "criu-logs" / op_id


def store_url(paths: Paths) -> str:
    return os.environ.get("SNAPSHOTTER_STORE") or paths.default_store
