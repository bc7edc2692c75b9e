"""A real coordinator process serves its Prometheus metrics (snapshotter/metrics.py) on
loopback: every rpc it answers is counted by method and code, refused ones included, and its
live gauges (agents, jobs) answer. The agents' endpoints and TLS beyond loopback are checked
during a real freeze in tests/e2e/test_multinode.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.rpc.client import Target, coordinator_client
from snapshotter.v1 import common_pb2
from tests.support.cli import ROOT
from tests.support.multinode import metric_samples
from tests.support.procs import CENSUS


def _scrape(url: str) -> dict[str, float]:
    out = subprocess.run(["curl", "-sf", url], capture_output=True, text=True, timeout=30,
                         check=True).stdout  # fmt: skip
    return metric_samples(out)


@pytest.fixture()
def coordinator(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(address, metrics URL, a viewer's token) of a coordinator process on loopback."""
    env = {"SNAPSHOTTER_HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    tokens = tmp_path / "tokens.json"
    token = subprocess.run(
        [sys.executable, "-m", "snapshotter", "token", "create", "--file", str(tokens),
         "--name", "prom", "--role", "viewer"],
        env=env, capture_output=True, text=True, check=True, timeout=60, cwd=ROOT,
    ).stdout.strip()  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotter", "coordinator", "--listen", "127.0.0.1:0",
         "--metrics-listen", "127.0.0.1:0", "--store", str(tmp_path / "store"),
         "--tokens", str(tokens), "--log-format", "json", "--log-level", "debug"],
        env=env, stdout=subprocess.PIPE, stderr=(tmp_path / "coordinator.log").open("wb"),
        text=True, cwd=ROOT,
    )  # fmt: skip
    CENSUS.keep(proc.pid, "function", "metrics endpoint test")
    try:
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        yield started["coordinator"], started["metrics"], token
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_coordinator_counts_every_rpc_and_serves_its_gauges(
    coordinator: tuple[str, str, str],
) -> None:
    address, url, token = coordinator
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics"), url
    ping_ok = 'snapshotter_rpc_seconds_count{code="ok",method="Ping"}'
    refused = 'snapshotter_rpc_seconds_count{code="unauthenticated",method="Jobs"}'
    before = _scrape(url)
    assert before['snapshotter_agents{state="live"}'] == 0
    assert "process_resident_memory_bytes" in before
    c = coordinator_client(Target(address, token=token))
    try:
        for _ in range(3):
            c.stub.Ping(common_pb2.Empty(), timeout=10)
    finally:
        c.close()
    anonymous = coordinator_client(Target(address))
    try:
        with pytest.raises(errors.Unauthenticated):
            anonymous.stub.Jobs(common_pb2.Empty(), timeout=10)
    finally:
        anonymous.close()
    after = _scrape(url)
    assert after[ping_ok] == before.get(ping_ok, 0) + 3, after
    assert after[refused] == before.get(refused, 0) + 1, after


def test_the_coordinator_logs_json_lines(
    coordinator: tuple[str, str, str], tmp_path: Path
) -> None:
    """--log-format json: every line of its log is one JSON object a log pipeline can read
    (the level filter itself: tests/unit/test_servicelog.py)."""
    address, _, token = coordinator
    c = coordinator_client(Target(address, token=token))
    try:
        c.stub.Ping(common_pb2.Empty(), timeout=10)
    finally:
        c.close()
    lines = (tmp_path / "coordinator.log").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records and all({"time", "level", "logger", "message", "pid"} <= r.keys()
                           for r in records), lines[:3]  # fmt: skip
    assert any(r["level"] == "info" and "coordinator" in r["message"] for r in records), lines
    assert {r["level"] for r in records} <= {"debug", "info", "warning", "error"}
