"""Finding the coordinator: a configured one, or the embedded local one (started on demand).

A configured coordinator comes from the environment:

    SNAPSHOTTER_COORDINATOR   HOST:PORT (or unix:PATH); unset = the embedded daemon
    SNAPSHOTTER_TLS_DIR       a directory from `snapshotter certs init` (this client presents
                              SNAPSHOTTER_TLS_NAME from it: default clients/admin)
    SNAPSHOTTER_TLS_CA, _CERT, _KEY   or the three files of an existing PKI
    SNAPSHOTTER_TLS_SERVER_NAME       the name in the coordinator's certificate (coordinator)
    SNAPSHOTTER_TOKEN, or SNAPSHOTTER_TOKEN_FILE   a bearer token (its role decides the rights)

The embedded daemon is started at most once per SNAPSHOTTER_HOME (a file lock serialises
concurrent CLIs), listens on root-only unix sockets and is reused until `snapshotter down`.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from snapshotter import errors, keeper
from snapshotter.config import Paths
from snapshotter.procutil import pid_alive
from snapshotter.rpc.client import Client, Target, coordinator_client
from snapshotter.rpc.tls import COORDINATOR_NAME, tls_files
from snapshotter.v1 import coordinator_pb2


def read_daemon(paths: Paths) -> dict[str, Any] | None:
    try:
        info = json.loads(paths.daemon_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not pid_alive(int(info.get("pid", 0))):
        return None
    return info


def _check_store(info: dict[str, Any]) -> None:
    wanted = os.environ.get("SNAPSHOTTER_STORE")
    if wanted and wanted != info.get("store"):
        raise errors.InvalidArgument(
            f"the embedded daemon uses store {info.get('store')!r}, not SNAPSHOTTER_STORE="
            f"{wanted!r}",
            "run `snapshotter down` so the next command starts it with the new store",
        )


def configured_target() -> Target | None:
    """The coordinator the environment names, with its credentials (None: embedded)."""
    env = os.environ
    address = env.get("SNAPSHOTTER_COORDINATOR")
    if not address:
        return None
    token = env.get("SNAPSHOTTER_TOKEN")
    token_file = env.get("SNAPSHOTTER_TOKEN_FILE")
    if not token and token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as e:
            raise errors.InvalidArgument(
                f"cannot read SNAPSHOTTER_TOKEN_FILE={token_file}: {e.strerror}",
                "point it at the file holding your token",
            ) from e
    tls = tls_files(
        env.get("SNAPSHOTTER_TLS_DIR"),
        env.get("SNAPSHOTTER_TLS_NAME", "clients/admin"),
        env.get("SNAPSHOTTER_TLS_CA"),
        env.get("SNAPSHOTTER_TLS_CERT"),
        env.get("SNAPSHOTTER_TLS_KEY"),
    )
    return Target(
        address,
        tls=tls,
        server_name=env.get("SNAPSHOTTER_TLS_SERVER_NAME", COORDINATOR_NAME),
        token=token or None,
    )


def coordinator(paths: Paths, start: bool = True) -> Client:
    target = configured_target()
    if target is not None:
        return coordinator_client(target)
    info = read_daemon(paths)
    if info is None:
        if not start:
            raise errors.ServiceUnavailable(
                f"no embedded coordinator is running for {paths.home}", "nothing to do"
            )
        info = _start_embedded(paths)
    _check_store(info)
    return coordinator_client(Target(info["coordinator"]))


def _start_embedded(paths: Paths, timeout: float = 60.0) -> dict[str, Any]:
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.home / "daemon.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = read_daemon(paths)
        if info is not None:
            return info
        if keeper.alive(paths.keeper_socket):
            # Its daemon died and is being started again (it re-adopts the jobs): a second
            # daemon beside it would take the sockets and lose them.
            info = _await_daemon(paths, timeout)
            if info is not None:
                return info
            raise errors.ServiceUnavailable(
                f"the embedded daemon's keeper runs, but no daemon came back within "
                f"{timeout:.0f}s; log {paths.daemon_log}",
                "see the log for why the daemon does not start",
            )
        with open(paths.daemon_log, "ab") as logf:
            # The keeper starts the daemon, and starts it again if it dies: the jobs outlive
            # a daemon crash (snapshotter/keeper.py).
            daemon = [sys.executable, "-m", "snapshotter.daemon", "embedded", "--home",
                      str(paths.home)]  # fmt: skip
            proc = subprocess.Popen(
                keeper.command(paths.keeper_socket, daemon),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                cwd="/",
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = read_daemon(paths)
            if info is not None and info.get("keeper") == proc.pid:
                return info
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = ""
        try:
            tail = paths.daemon_log.read_text(errors="replace")[-1500:]
        except OSError:
            pass
        if proc.poll() is None:
            proc.kill()
        raise errors.ServiceUnavailable(
            f"the embedded coordinator did not start; log {paths.daemon_log}:\n{tail}",
            "fix the cause shown in the log, then retry",
        )


def _await_daemon(paths: Paths, timeout: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = read_daemon(paths)
        if info is not None:
            return info
        time.sleep(0.2)
    return None


def stop_embedded(paths: Paths, force: bool, timeout: float = 60.0) -> bool:
    info = read_daemon(paths)
    if info is None:
        return False
    client = coordinator_client(Target(info["coordinator"]))
    try:
        client.stub.Shutdown(coordinator_pb2.ShutdownRequest(force=force), timeout=120)
    finally:
        client.close()
    pid = int(info["pid"])
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if pid_alive(pid):
        raise errors.ServiceUnavailable(
            f"the embedded daemon (pid {pid}) did not stop within {timeout:.0f}s",
            f"kill it by pid ({pid}) if it is stuck",
        )
    return True
