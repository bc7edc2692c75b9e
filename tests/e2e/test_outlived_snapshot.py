"""A snapshot stays thawable while its job goes on: freeze-and-continue, the job keeps writing
its 'w', 'r+', 'a' and 'a+' files and posting to an HTTP service over a keep-alive connection,
then a rank dies; the thaw continues the job, its files read exactly as an uninterrupted run's,
its connection comes back closed and its client reconnects, and it finishes bit-identical."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import signal
import socketserver
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cli import ROOT, SnapCli
from tests.support.soak import rank_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
JOB = ROOT / "tests" / "support" / "jobs" / "writes_and_posts.py"
STEPS = "220"
FILES = ("metrics.csv", "summary.txt", "events.log", "history.log")


class Service:
    """A real HTTP service on loopback that records every step a job posts."""

    def __init__(self) -> None:
        # (connection, step) in the order received; connections are numbered as accepted.
        self.posts: list[tuple[int, int]] = []
        self.accepted: list[int] = []
        received, opened = self.posts, self.accepted
        numbers = itertools.count()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: one connection for the whole run

            def setup(self) -> None:
                super().setup()
                self.conn = next(numbers)
                opened.append(self.conn)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.conn, int(json.loads(body)["step"])))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def steps(self) -> list[int]:
        return [step for _, step in self.posts]

    def connections(self) -> set[int]:
        """Every connection accepted so far."""
        return set(self.accepted)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def service() -> Iterator[Service]:
    s = Service()
    yield s
    s.close()


def _start(snap: SnapCli, out: Path, files: Path, *extra: str) -> str:
    p = snap.run("run", "--detach", "--nproc-per-node", "2", str(JOB), "--out", str(out),
                 "--files", str(files), "--steps", STEPS, *extra)  # fmt: skip
    return p.stdout.strip().splitlines()[-1]


def _result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_what_the_job_went_on_writing_and_posting_after_its_snapshot(
    snap: SnapCli, tmp_path: Path, service: Service
) -> None:
    ref_files = tmp_path / "ref-files"
    ref = _start(snap, tmp_path / "ref.json", ref_files)
    assert snap.wait(ref)["state"] == "SUCCEEDED"

    live_files = tmp_path / "live-files"
    # Paced: 220 unpaced steps took ~20 s, and the freeze, 20 more steps and the status calls
    # below once outlasted the job here (its rank was gone before the test could kill it).
    job = _start(snap, tmp_path / "live.json", live_files, "--post", service.url,
                 "--step-sleep", "0.25")  # fmt: skip
    snap.wait_step(job, 40)
    sid = snap.run("freeze", job).stdout.strip().splitlines()[-1]
    posted_at_freeze = max(service.steps)  # the snapshot was taken at or before this step
    after = (live_files / "metrics.csv").read_text().count("\n")
    snap.wait_step(job, snap.last_step(job) + 20)  # it goes on writing every file...
    assert (live_files / "metrics.csv").read_text().count("\n") >= after + 15
    init = next(r["pid"] for r in snap.json("status", job)["ranks"] if r["rank"] == 1)
    rank = rank_process(init)
    assert rank is not None, snap.json("status", job)
    # The freeze cost its connection nothing: every post so far went over the first one.
    assert service.connections() == {0}, service.posts
    os.kill(rank, signal.SIGKILL)  # ... and then a rank dies
    assert snap.wait(job)["state"] == "FAILED"

    # What the dead job sent may still be on its way into the service (a request its handler
    # thread has not read yet): the thawed job's posts are those on connections it opened.
    before_thaw = service.connections()

    thawed = snap.json("thaw", sid)["job_id"]
    assert thawed == job  # the job goes on under its own id
    st = snap.wait(thawed)
    assert st["state"] == "SUCCEEDED", st
    live, reference = _result(tmp_path / "live.json"), _result(tmp_path / "ref.json")
    assert live["digest"] == reference["digest"]
    for name in FILES:
        assert (live_files / name).read_bytes() == (ref_files / name).read_bytes(), name
    # Its connection came back closed: the client saw a reset and reconnected, and the
    # service received every step from the snapshot's on to the last.
    assert live["resets"] >= 1
    after = [step for conn, step in service.posts if conn not in before_thaw]
    assert after == list(range(after[0], int(STEPS) + 1)) and after[0] <= posted_at_freeze + 1


def test_a_failed_restore_names_crius_first_error(snap: SnapCli, tmp_path: Path) -> None:
    """A file the job held open is gone when the thaw comes: CRIU's first error (which file,
    and why) leads the message, not CRIU's last line ("Restoring FAILED")."""
    data = tmp_path / "dataset.bin"
    data.write_bytes(b"\0" * 4096)
    job = _start(snap, tmp_path / "out.json", tmp_path / "files", "--hold", str(data),
                 "--step-sleep", "0.05")  # fmt: skip
    snap.wait_step(job, 20)
    sid = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    data.unlink()
    p = snap.run("thaw", sid, check=False)
    assert p.returncode == 10, p.stderr  # CriuFailed
    first = next(ln for ln in p.stderr.splitlines() if ln.startswith("error:"))
    assert "criu restore failed: Can't open file" in first and "dataset.bin" in first, first
    assert "No such file or directory" in first
    assert snap.json("jobs")["jobs"][-1]["state"] != "RUNNING"  # nothing half-started
