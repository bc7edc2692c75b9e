"""Where snapshotter keeps its state on a node, and the settings read from the environment.

SNAPSHOTTER_HOME     state directory (default /var/lib/snapshotter as root, else
                     ~/.local/state/snapshotter)
SNAPSHOTTER_STORE    snapshot storage URL: a directory path, file:///path or s3://bucket/prefix
                     (S3 endpoint and credentials the AWS way: AWS_ENDPOINT_URL, AWS_* keys)
SNAPSHOTTER_COORDINATOR  host:port of a remote coordinator; unset = the embedded local one
SNAPSHOTTER_PRIVATE_TMP  1 (default): each rank sandbox has its own TMPDIR (a tmpfs dumped with
                     it); 0: ranks share the node's /tmp and keep the caller's TMPDIR
SNAPSHOTTER_KEEP_JOBS    finished jobs (status, rank logs) a service keeps (default 100)
SNAPSHOTTER_LOCAL_COPY_BYTES  how much of the home's disk the newest snapshot of each job may
                     keep on the node that made it, so a thaw there needs no fetch (default:
                     a quarter of that filesystem; 0: keep none)
SNAPSHOTTER_UPLOAD_NICE  CPU priority (nice 0..19, default 19) of a freeze's upload while the
                     job trains on: it yields every core the job wants and uses the idle rest
                     (with --stop the ranks are held, and the upload runs at full priority)
SNAPSHOTTER_FORMAT_VERSION  snapshot format written: 2 (default; shared, deduplicated chunks)
                     or 1 (a fleet with agents that read only 1)
SNAPSHOTTER_CODEC    auto (default: zstd where a sample compresses, raw elsewhere) | zstd |
                     lz4 | none; SNAPSHOTTER_ZSTD_LEVEL (default 1)
SNAPSHOTTER_CHUNK_CACHE_BYTES  disk for the node's cache of stored chunks (default 4 GiB;
                     0: none)
SNAPSHOTTER_GC_INTERVAL_S  how often a coordinator sweeps shared chunks no snapshot lists
                     (default 600; 0: only `snapshotter gc --delete`)
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from snapshotter.storage.codec import CodecPolicy

# sun_path holds 108 bytes; leave room for "/coordinator.sock" and the NUL.
_MAX_SOCKET_DIR = 88


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
    def run_dir(self) -> Path:
        """Where the embedded daemon's unix sockets live (0700). A socket path must fit in
        108 bytes: a deep SNAPSHOTTER_HOME gets a short directory named after it instead."""
        run = self.home / "run"
        if len(str(run)) <= _MAX_SOCKET_DIR:
            return run
        digest = hashlib.sha256(str(self.home).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"snapshotter-run-{os.geteuid()}" / digest

    @property
    def keeper_socket(self) -> Path:
        """The keeper's socket (snapshotter/keeper.py), for the embedded daemon or an agent."""
        return self.run_dir / "keeper.sock"

    @property
    def tenants_file(self) -> Path:
        """Per-tenant limits on snapshots (coordinator/quotas.py)."""
        return self.home / "tenants.json"

    @property
    def webhooks_file(self) -> Path:
        """Where each tenant's job events are sent (coordinator/webhooks.py), with secrets."""
        return self.home / "webhooks.json"

    @property
    def audit_log(self) -> Path:
        """The coordinator's append-only audit log (rpc/audit.py)."""
        return self.home / "audit.log"

    @property
    def keys_dir(self) -> Path:
        """The coordinator's snapshot signing key and the keys it trusts (storage/signing.py);
        SNAPSHOTTER_KEYS_DIR moves it (keep it off the store's disk)."""
        return Path(os.environ.get("SNAPSHOTTER_KEYS_DIR") or self.home / "keys")

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

    @property
    def copies_dir(self) -> Path:
        return self.home / "copies"


def store_url(paths: Paths) -> str:
    return os.environ.get("SNAPSHOTTER_STORE") or paths.default_store


def _whole_number(name: str, default: str, next_step: str, top: int | None = None) -> int:
    """Environment variable `name` as a whole number >= 0 and at most `top` (`default` when
    unset or blank).

    Raises: InvalidArgument naming the variable and `next_step`.
    """
    from snapshotter import errors

    raw = os.environ.get(name, "").strip() or default
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise errors.InvalidArgument(f"{name}={raw!r} is not a whole number >= 0", next_step)
    if top is not None and n > top:
        raise errors.InvalidArgument(f"{name}={n} is above {top}", next_step)
    return n


def encrypt_at_rest() -> bool:
    """SNAPSHOTTER_ENCRYPT: 1 (default) seals every snapshot's chunks under its tenant's data
    key (storage/sealing.py); 0 stores them in plaintext (a fleet with agents that cannot read
    format 3)."""
    return bool(_whole_number("SNAPSHOTTER_ENCRYPT", "1", "set 1 (default) or 0", top=1))


def keep_jobs() -> int:
    """SNAPSHOTTER_KEEP_JOBS, the finished jobs a service remembers (default 100).

    Raises: InvalidArgument if it is not a whole number >= 0.
    """
    return _whole_number("SNAPSHOTTER_KEEP_JOBS", "100", "fix or unset it")


def local_copy_bytes(home: Path) -> int:
    """SNAPSHOTTER_LOCAL_COPY_BYTES: the disk the node's local snapshot copies may use
    (default a quarter of the filesystem holding `home`; 0 turns them off).

    Raises: InvalidArgument if it is not a whole number >= 0.
    """
    if os.environ.get("SNAPSHOTTER_LOCAL_COPY_BYTES", "").strip():
        return _whole_number(
            "SNAPSHOTTER_LOCAL_COPY_BYTES", "0",
            "fix it (bytes), or unset it for a quarter of the disk; 0 keeps no local copies",
        )  # fmt: skip
    home.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(home)
    return st.f_blocks * st.f_frsize // 4


def rdzv_spares() -> int:
    """SNAPSHOTTER_RDZV_SPARES (default 0): how many standby rendezvous servers (each a Python
    that imported torch) an agent keeps for the next thaw of `--recover auto` jobs whose node 0
    it is, so a recovery there does not wait for the import.

    Raises: InvalidArgument if it is not a whole number in 0..16.
    """
    return _whole_number("SNAPSHOTTER_RDZV_SPARES", "0", "set a number from 0 to 16", top=16)


def upload_nice() -> int:
    """SNAPSHOTTER_UPLOAD_NICE (default 19).

    Raises: InvalidArgument if it is not a whole number in 0..19.
    """
    return _whole_number("SNAPSHOTTER_UPLOAD_NICE", "19", "set a nice value from 0 to 19", top=19)


def format_version() -> int:
    """SNAPSHOTTER_FORMAT_VERSION (default 2): the snapshot format agents write. 1 (per-snapshot
    chunks, no dedup) only while some agent of the fleet still runs a release that reads only 1.

    Raises: InvalidArgument if it is not 1 or 2.
    """
    n = _whole_number(
        "SNAPSHOTTER_FORMAT_VERSION", "2", "set 2 (default) or 1 for a fleet with older readers",
        top=2,
    )
    if n < 1:
        from snapshotter import errors

        raise errors.InvalidArgument(
            "SNAPSHOTTER_FORMAT_VERSION=0 is not a snapshot format", "set 2 (default) or 1"
        )
    return n


def codec_policy() -> CodecPolicy:
    """SNAPSHOTTER_CODEC (auto|zstd|lz4|none, default auto: zstd level SNAPSHOTTER_ZSTD_LEVEL,
    default 1, for chunks a sample shows compressible, none for the rest).

    Raises: InvalidArgument for an unknown codec or a level outside 1..19.
    """
    from snapshotter import errors
    from snapshotter.storage.codec import CODECS, CodecPolicy

    codec = os.environ.get("SNAPSHOTTER_CODEC", "").strip() or "auto"
    if codec not in CODECS:
        raise errors.InvalidArgument(
            f"SNAPSHOTTER_CODEC={codec!r} is not a known codec", f"use one of {', '.join(CODECS)}"
        )
    level = _whole_number("SNAPSHOTTER_ZSTD_LEVEL", "1", "set a zstd level from 1 to 19", top=19)
    return CodecPolicy(codec=codec, zstd_level=max(level, 1))


def chunk_cache_bytes() -> int:
    """SNAPSHOTTER_CHUNK_CACHE_BYTES (default 4 GiB; 0: no cache): how much disk the node's
    cache of stored chunks may use, so a thaw or migration onto a node that has them fetches
    nothing again.

    Raises: InvalidArgument if it is not a whole number >= 0.
    """
    return _whole_number(
        "SNAPSHOTTER_CHUNK_CACHE_BYTES", str(4 << 30), "set bytes, or 0 for no chunk cache"
    )


def gc_interval() -> int:
    """SNAPSHOTTER_GC_INTERVAL_S (default 600; 0: never): how often a coordinator sweeps the
    shared chunks no committed snapshot lists (older than gc's default grace period).

    Raises: InvalidArgument if it is not a whole number >= 0.
    """
    return _whole_number("SNAPSHOTTER_GC_INTERVAL_S", "600", "set seconds, or 0 to sweep only "
                         "with `snapshotter gc --delete`")  # fmt: skip
