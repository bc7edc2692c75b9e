"""The embedded daemon runs 10 short jobs in a row (freezes, thaws, a killed rank and refused
freezes among them) and ends holding what it held after the first job: no leak per job,
freeze or thaw. Real CRIU, real ranks, the real CLI; resources read from /proc. (Hundreds of
jobs, on one node and on netns nodes: bench/soak_bench.py; SNAPSHOTTER_SOAK_JOBS here.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snapshotter.agent.retention import Retention
from tests.support.cli import SnapCli
from tests.support.soak import KILL_AT, REFUSE_AFTER, Soak, describe, leftovers

JOBS = int(os.environ.get("SNAPSHOTTER_SOAK_JOBS", "10"))
# What may differ between the agent after its first job (which already froze, stopped and
# thawed) and after the last one. Threads and fds: a few for gRPC's pool and channels warming
# up; RSS: the records of finished jobs it keeps (up to Retention.finished_jobs, ~60 KB each
# here) and the allocator settling.
FD_SLACK = 4
THREAD_SLACK = 4
RSS_SLACK = 16 << 20


def _daemon_pid(cli: SnapCli) -> int:
    return int(json.loads((cli.home / "daemon.json").read_text())["pid"])


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_many_jobs_leak_nothing(
    snap: SnapCli, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snap.run("jobs")  # starts the daemon
    soak = Soak(snap, tmp_path, lambda: {"daemon": _daemon_pid(snap)})
    first = {}

    def on_job(i: int, s: object) -> None:
        if i == 1:
            first.update(soak.settle().by_agent)

    report = soak.run(JOBS, on_job)
    base = first["daemon"]
    end = soak.settle().by_agent["daemon"]
    lines = [
        f"soak of {JOBS} jobs: {report.outcomes}",
        f"  after job 1:  {describe(base)}",
        f"  after job {JOBS}: {describe(end)}",
        *(f"  slope of {m} per job: {report.slope('daemon', m):+.3f}"
          for m in ("fds", "threads", "rss_bytes")),
    ]  # fmt: skip
    with capsys.disabled():  # the figures belong in every CI log, passing or not
        print("\n" + "\n".join(lines))

    assert report.outcomes["launched"] == JOBS  # every launch succeeded (else it raised)
    assert report.outcomes["rank_killed"] == int(JOBS >= KILL_AT)
    assert report.outcomes["refused"] == sum(i <= JOBS for i in REFUSE_AFTER)
    assert report.outcomes["thawed"] == 1 + JOBS // 5
    assert end.children == 0 and end.zombies == 0, describe(end)
    assert end.fds <= base.fds + FD_SLACK, (describe(base), describe(end))
    assert end.threads <= base.threads + THREAD_SLACK, (describe(base), describe(end))
    assert end.rss_bytes <= base.rss_bytes + RSS_SLACK, (describe(base), describe(end))
    assert leftovers(snap.home) == {"work": [], "sandbox": [], "sandboxes": []}
    criu_logs = snap.home / "criu-logs"
    kept = len(list(criu_logs.iterdir())) if criu_logs.is_dir() else 0
    assert kept <= Retention().criu_log_dirs

    # What the daemon reports about itself is what /proc says.
    st = snap.json("status")
    me = st["coordinator"]["resources"]
    assert me["pid"] == end.pid and me["zombies"] == 0 and me["children"] == 0
    assert [n["agent"]["resources"]["pid"] for n in st["nodes"]] == [end.pid]
    assert abs(me["threads"] - end.threads) <= THREAD_SLACK
