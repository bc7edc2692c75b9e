"""The systemd units of deploy/systemd/: they parse cleanly, every flag they pass is one the
CLI takes (with the example environment file's values), and a real service tells systemd it is
ready and stopping over NOTIFY_SOCKET (`Type=notify`)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from snapshotter.cli.main import build_parser
from tests.support.cli import ROOT
from tests.support.procs import CENSUS

UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))


def _example_env() -> dict[str, str]:
    env = {}
    for line in (ROOT / "deploy" / "systemd" / "snapshotter.env.example").read_text().splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k] = v
    return env


def test_the_units_parse_cleanly() -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    assert len(UNITS) == 2
    p = subprocess.run([tool, "verify", *map(str, UNITS)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    # verify exits 0 on settings it ignores: any line it prints is a defect.
    assert p.returncode == 0 and not p.stderr.strip() and not p.stdout.strip(), p.stderr


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_every_flag_a_unit_passes_is_the_clis(unit: Path) -> None:
    text = unit.read_text()
    line = next(x for x in text.splitlines() if x.startswith("ExecStart="))
    env = _example_env()
    expanded = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line.removeprefix("ExecStart="))
    argv = shlex.split(expanded)
    assert argv[0] == "/usr/local/bin/snapshotter"  # where deploy/install.sh links it
    a = build_parser().parse_args(argv[1:])  # an unknown flag exits here
    assert a.metrics_listen and a.tls_dir == env["SNAPSHOTTER_TLS_DIR"]
    for setting in ("Type=notify", "StateDirectory=snapshotter", "LimitNOFILE="):
        assert setting in text, (unit.name, setting)
    if "agent" in unit.name:
        assert "LimitMEMLOCK=infinity" in text and "NotifyAccess=all" in text
        assert "KillMode=process" in text  # systemd never signals the ranks


def test_a_service_tells_systemd_it_is_ready_and_stopping(tmp_path: Path) -> None:
    sock_path = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(sock_path))
    listener.settimeout(60)
    env = {"SNAPSHOTTER_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT), "NOTIFY_SOCKET": str(sock_path)}  # fmt: skip
    tokens = tmp_path / "tokens.json"
    subprocess.run([sys.executable, "-m", "snapshotter", "token", "create", "--file",
                    str(tokens), "--name", "x", "--role", "viewer"], env=env, check=True,
                   capture_output=True, timeout=60, cwd=ROOT)  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter", "coordinator", "--listen", "127.0.0.1:0",
         "--store", str(tmp_path / "store"), "--tokens", str(tokens)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    CENSUS.keep(proc.pid, "function", "systemd notify test")
    try:
        ready = listener.recv(4096).decode().splitlines()
        assert ready[0] == "READY=1" and ready[1].startswith("STATUS=serving 127.0.0.1:"), ready
        os.kill(proc.pid, signal.SIGTERM)
        assert listener.recv(4096).decode().splitlines()[0] == "STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        listener.close()
