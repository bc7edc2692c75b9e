"""Finding the coordinator: a configured one, or the embedded local one (started on demand).

The embedded daemon is started at most once per SNAPSHOTTER_HOME (a file lock serialises
concurrent CLIs) and reused until `snapshotter down`.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from typing import Any

from coordinator.service import COORDINATOR_SERVICE
from snapshotter import errors
from snapshotter.config import Paths
from snapshotter.procutil import pid_alive
from snapshotter.rpc.wire import Client


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


def coordinator_client(paths: Paths, start: bool = True) -> Client:
    addr = os.environ.get("SNAPSHOTTER_COORDINATOR")
    if addr:
        return Client(addr, COORDINATOR_SERVICE)
    info = read_daemon(paths)
    if info is None:
        if not start:
            raise errors.ServiceUnavailable(
                f"no embedded coordinator is running for {paths.home}", "nothing to do"
            )
        info = _start_embedded(paths)
    _check_store(info)
    return Client(info["coordinator"], COORDINATOR_SERVICE)


def _start_embedded(paths: Paths, timeout: float = 60.0) -> dict[str, Any]:
    paths.home.mkdir(parents=True, exist_ok=True)
    with open(paths.home / "daemon.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = read_daemon(paths)
        if info is not None:
            return info
        with open(paths.daemon_log, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "snapshotter.daemon", "embedded", "--home", str(paths.home)],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                start_new_session=True,
                cwd="/",
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = read_daemon(paths)
            if info is not None and info.get("pid") == proc.pid:
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


def stop_embedded(paths: Paths, force: bool, timeout: float = 60.0) -> bool:
    info = read_daemon(paths)
    if info is None:
        return False
    Client(info["coordinator"], COORDINATOR_SERVICE).call("Shutdown", {"force": force})
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
