"""A node's rendezvous servers (snapshotter/agent/rdzv.py) with real processes and a real
c10d TCPStore: a job that recovers by itself gets a spare that has imported torch already,
the next open of the job takes it (and keeps a new one), and spares are bounded and expire."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from snapshotter.agent.rdzv import RdzvHost
from tests.support.procs import dead

pytestmark = pytest.mark.timeout(240)
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


@pytest.fixture
def host() -> Iterator[RdzvHost]:
    h = RdzvHost("127.0.0.1", max_spares=2)
    yield h
    h.stop_all()


def _serves(port: int) -> None:
    import torch.distributed as dist

    c = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30),
                      wait_for_workers=False)  # fmt: skip
    c.set("k", "v")
    assert c.get("k") == b"v"


def test_the_next_open_of_a_job_takes_its_spare(host: RdzvHost) -> None:
    first = host.open("job-1", sys.executable, ENV, spare=True)
    _serves(first.port)
    assert host.spares() == ["job-1"]
    spare = host._spares["job-1"].server
    time.sleep(5)  # its torch import is done by the time a failure is detected
    again = host.open("job-1", sys.executable, ENV, spare=True)
    assert host._servers["job-1"] is spare and again.port != first.port
    _serves(again.port)
    assert host.spares() == ["job-1"] and host._spares["job-1"].server is not spare


def test_spares_are_bounded_to_the_newest_jobs_and_expire(host: RdzvHost) -> None:
    for j in ("a", "b", "c"):
        host.open(j, sys.executable, ENV, spare=True)
    assert host.spares() == ["b", "c"]
    pids = [host._spares[j].server.pid for j in ("b", "c")]
    assert host.expire_spares({"c"}, idle_s=3600) == []
    time.sleep(0.2)
    assert host.expire_spares({"c"}, idle_s=0.1) == ["b"]
    assert host.spares() == ["c"]
    host.stop_all()
    for pid in pids:
        deadline = time.monotonic() + 10
        while not dead(pid):
            assert time.monotonic() < deadline, f"spare {pid} still runs"
            time.sleep(0.1)


def test_a_job_without_recovery_gets_no_spare(host: RdzvHost) -> None:
    addr = host.open("plain", sys.executable, ENV)
    _serves(addr.port)
    assert host.spares() == []
