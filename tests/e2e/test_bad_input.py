"""End to end: bad input and faults. Each gives one clear error naming the cause and the next
step; the job keeps running where it was running, and no partial snapshot becomes visible."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.cli import ROOT, SnapCli, read_result

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ARGS = ("--steps", "160", "--step-sleep", "0.03")


def _store_files(home: Path) -> list[Path]:
    """Snapshot objects in the store; the jobs' journals (jobs/<id>/life.json, which keep a
    running job's events, a failed freeze's among them, for the next coordinator) are not."""
    store = home / "store"
    if not store.exists():
        return []
    return sorted(p for p in store.rglob("*")
                  if p.is_file() and p.relative_to(store).parts[0] != "jobs")  # fmt: skip


def test_unknown_ids(snap: SnapCli) -> None:
    for args, needle in [
        (("freeze", "no-such-job"), "no job with id 'no-such-job'"),
        (("status", "no-such-job"), "no job with id"),
        (("logs", "no-such-job"), "no job with id"),
        (("thaw", "no-such-snap"), "no committed snapshot with id 'no-such-snap'"),
        (("show", "no-such-snap"), "no committed snapshot"),
        (("delete", "no-such-snap"), "no committed snapshot"),
    ]:
        p = snap.run(*args, check=False)
        assert p.returncode == 3, (args, p.stderr)
        assert needle in p.stderr and "next step:" in p.stderr, p.stderr
    p = snap.run("freeze", "bad/id", check=False)
    assert p.returncode in (2, 3) and "next step:" in p.stderr


def test_freeze_of_a_finished_job_is_refused(snap: SnapCli, tmp_path: Path) -> None:
    job = snap.start_job(tmp_path / "o.json", "--steps", "5")
    assert snap.wait(job)["state"] == "SUCCEEDED"
    p = snap.run("freeze", job, check=False)
    assert p.returncode == 5, p.stderr
    assert "SUCCEEDED" in p.stderr and "only a running job can be frozen" in p.stderr
    # top has nothing to sample either, and says why rather than showing ranks not answering.
    p = snap.run("top", job, check=False)
    assert p.returncode == 4 and "has ended (SUCCEEDED)" in p.stderr, p.stderr
    assert "next step:" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert snap.json("list")["snapshots"] == []
    assert _store_files(snap.home) == []


def test_concurrent_freeze_refused_and_quiesce_deadline(snap: SnapCli, tmp_path: Path) -> None:
    """A job in a long phase without collectives never reaches the barrier: the freeze fails at
    its deadline, a second freeze meanwhile is refused, and the job goes on, unharmed."""
    out = tmp_path / "o.json"
    job = snap.start_job(out, *ARGS, "--pause-at", "30", "--pause-s", "25")
    snap.wait_step(job, 30)
    first = subprocess.Popen(
        [sys.executable, "-m", "snapshotter", "freeze", job, "--quiesce-timeout", "8"],
        env=snap.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stderr is not None
        seen = []
        for line in first.stderr:
            seen.append(line)
            if "quiesce" in line:
                break
        assert any("quiesce" in s for s in seen), seen
        second = snap.run("freeze", job, check=False)
        assert second.returncode == 5, second.stderr
        assert "another freeze, thaw or migration of job" in second.stderr
        rest = first.stderr.read()
        first.wait(60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 6, rest
    assert "did not reach collective barrier" in rest and "left running" in rest
    # The error says what the ranks were doing instead: in the script's pause, no collective
    # behind or in flight.
    assert "its barrier is armed; no group behind the others; threads: " in rest, rest
    assert "MainThread: train_ddp.py:" in rest and " main" in rest, rest
    assert snap.json("status", job)["state"] == "RUNNING"
    assert snap.json("list")["snapshots"] == []
    assert _store_files(snap.home) == []
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    # Same numbers as an undisturbed run of the same script.
    ref = tmp_path / "ref.json"
    ref_job = snap.start_job(ref, *ARGS)
    assert snap.wait(ref_job)["state"] == "SUCCEEDED"
    assert read_result(out) == read_result(ref)


def _start_socket_job(snap: SnapCli, *args: str) -> str:
    script = ROOT / "tests" / "support" / "jobs" / "holds_socket.py"
    job = snap.run("run", "--detach", "--nproc-per-node", "2", str(script), *args).stdout.split()[
        -1
    ]
    deadline = time.monotonic() + 60
    while "step 20 " not in snap.log(job):
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.2)
    return job


def test_unknown_tcp_connection_refused_at_suspend(snap: SnapCli) -> None:
    """A TCP connection neither the hook nor the job's Python code opened (a C library's) may
    be a communicator the hook cannot rebuild: refused by name, the job goes on."""
    job = _start_socket_job(snap, "tcp")
    p = snap.run("freeze", job, check=False)
    assert p.returncode == 6, p.stderr
    assert "another C library still open" in p.stderr and "ESTABLISHED" in p.stderr
    assert "next step:" in p.stderr
    assert snap.json("list")["snapshots"] == []
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert "rank 0 done total 600.0" in snap.log_path(job).read_text()


def test_failed_criu_dump_reports_log_and_job_continues(snap: SnapCli, tmp_path: Path) -> None:
    """A unix connection to a peer outside the job: CRIU refuses to dump it."""
    import socket
    import threading

    path = str(tmp_path / "peer.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    conns: list[socket.socket] = []
    threading.Thread(
        target=lambda: [conns.append(srv.accept()[0]) for _ in range(2)], daemon=True
    ).start()
    try:
        job = _start_socket_job(snap, "unix", path)
        p = snap.run("freeze", job, check=False)
        assert p.returncode == 10, p.stderr
        # CRIU's first real error leads the message; the log and its last errors follow.
        assert "criu dump failed: unix: External socket" in p.stderr, p.stderr
        assert "; log:" in p.stderr and "last errors:" in p.stderr
        log_path = p.stderr.split("log:", 1)[1].split()[0]
        assert os.path.exists(log_path), log_path
        assert "Error" in p.stderr.split("last errors:", 1)[1]
        assert snap.json("list")["snapshots"] == []
        st = snap.wait(job)
        assert st["state"] == "SUCCEEDED", st
        assert "rank 0 done total 600.0" in snap.log_path(job).read_text()
    finally:
        for c in conns:
            c.close()
        srv.close()


def test_criu_too_old_refuses_before_touching_the_job(
    tmp_path: Path, make_snap: Callable[..., SnapCli]
) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    cli = make_snap({"SNAPSHOTTER_CRIU": str(fake)})
    out = tmp_path / "o.json"
    job = cli.start_job(out, *ARGS)
    cli.wait_step(job, 10)
    p = cli.run("freeze", job, check=False)
    assert p.returncode == 9, p.stderr
    assert "3.17" in p.stderr and "install-criu.sh" in p.stderr
    assert cli.json("status", job)["state"] == "RUNNING"
    assert cli.wait(job)["state"] == "SUCCEEDED"
    assert _store_files(cli.home) == []


def test_storage_unreachable_fails_cleanly(
    tmp_path: Path, make_snap: Callable[..., SnapCli]
) -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    env = {
        "SNAPSHOTTER_STORE": "s3://nobucket/snaps",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "AWS_REGION": "us-east-1",
    }
    cli = make_snap(env)
    out = tmp_path / "o.json"
    job = cli.start_job(out, *ARGS)
    cli.wait_step(job, 10)
    p = cli.run("freeze", job, "--stop", check=False)
    assert p.returncode == 8, p.stderr
    assert f"127.0.0.1:{port}" in p.stderr and "next step:" in p.stderr
    assert cli.json("status", job)["state"] == "RUNNING"
    assert cli.wait(job)["state"] == "SUCCEEDED"


def test_corrupt_chunk_fails_thaw_before_any_process_starts(snap: SnapCli, tmp_path: Path) -> None:
    job = snap.start_job(tmp_path / "o.json", *ARGS)
    snap.wait_step(job, 20)
    snapshot = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    store = snap.home / "store"
    manifest = json.loads((store / "snapshots" / snapshot / "manifest.json").read_bytes())
    keys = sorted({c["key"] for s in manifest["streams"].values() for c in s["chunks"]})
    victim = store / keys[len(keys) // 2]
    data = bytearray(good := victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    # A thaw that must fetch: without the node's own copy of the images (a thaw on another
    # node, or a copy evicted). With the copy, the thaw would restore from it, checked
    # against the manifest: the store's damaged chunk is never read.
    shutil.rmtree(snap.home / "copies")
    p = snap.run("thaw", snapshot, check=False)
    assert p.returncode == 7, p.stderr
    assert snapshot in p.stderr and "chunk" in p.stderr and "next step:" in p.stderr
    jobs = snap.json("jobs")["jobs"]
    assert [j["state"] for j in jobs] == ["FROZEN"]  # no thawed job, no running rank
    assert all(r["exit_code"] is not None for j in jobs for r in j["ranks"])
    assert snapshot in [s["snapshot_id"] for s in snap.json("list")["snapshots"]]
    victim.write_bytes(good)
    _untrusted_snapshots_are_refused(snap, snapshot, tmp_path)


def _untrusted_snapshots_are_refused(snap: SnapCli, snapshot: str, tmp_path: Path) -> None:
    """The same frozen job's snapshot, altered as someone who can write to the store would:
    every chunk still matches its hash, only the signature tells."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from snapshotter.storage.signing import Signer

    where = snap.home / "store" / "snapshots" / snapshot
    body, sig = (where / "manifest.json").read_bytes(), (where / "manifest.sig").read_bytes()

    def refused(why: str, *args: str) -> None:
        p = snap.run("thaw", snapshot, *args, "--json", check=False)
        assert p.returncode == 7, (p.stdout, p.stderr)
        err = json.loads(p.stdout.strip().splitlines()[-1])["error"]
        assert err["code"] == "snapshot_untrusted" and why in err["cause"], err
        assert err["next_step"], err
        assert [j["state"] for j in snap.json("jobs")["jobs"]] == ["FROZEN"]

    # Two chunks of a rank's image swapped in the manifest: valid chunks, valid hashes.
    m = json.loads(body)
    chunks = max((s["chunks"] for s in m["streams"].values()), key=len)
    a, b = chunks[1], chunks[2]
    for k in set(a) - {"index"}:
        a[k], b[k] = b[k], a[k]
    (where / "manifest.json").write_bytes(json.dumps(m).encode())
    refused("altered")
    (where / "manifest.json").write_bytes(body)
    # Signed by a coordinator this one does not trust.
    (where / "manifest.sig").write_bytes(Signer(Ed25519PrivateKey.generate()).sign(body))
    refused("does not trust")
    # Not signed at all: refused, unless the operator says it may be (taken before signing).
    (where / "manifest.sig").unlink()
    refused("not signed")
    job = snap.json("thaw", snapshot, "--allow-unsigned")["job_id"]
    assert snap.wait(job)["state"] == "SUCCEEDED"
    (where / "manifest.sig").write_bytes(sig)


def test_freeze_right_at_launch_never_breaks_the_job(snap: SnapCli, tmp_path: Path) -> None:
    """Ranks still importing torch or connecting their process group when the freeze comes:
    the freeze either completes or is refused cleanly; the job always finishes, unchanged."""
    out = tmp_path / "o.json"
    job = snap.start_job(out, *ARGS)
    outcomes = []
    for _ in range(3):
        p = snap.run("freeze", job, "--quiesce-timeout", "20", check=False)
        outcomes.append(p.returncode)
        assert p.returncode in (0, 5, 6), p.stderr
        if p.returncode:
            assert "next step:" in p.stderr
    assert snap.wait(job)["state"] == "SUCCEEDED"
    ref = tmp_path / "ref.json"
    assert snap.wait(snap.start_job(ref, *ARGS))["state"] == "SUCCEEDED"
    assert read_result(out) == read_result(ref)


def test_a_freeze_refused_during_set_up_leaves_no_rank_held(
    make_snap: Callable[..., SnapCli], tmp_path: Path
) -> None:
    """Rank 0 waits in init_process_group for rank 1, which joins 20 s late: a freeze then is
    refused by rank 0, and rank 1, which prepared, must let go at once. Held, rank 1's own
    init_process_group would wait for the hold's deadline (here 10 minutes: the job would not
    finish within the wait below)."""
    snap = make_snap({"SNAPSHOTTER_HOLD_S": "600"})
    out = tmp_path / "o.json"
    job = snap.start_job(out, *ARGS, "--startup-s", "20", "--startup-rank", "1")
    deadline = time.monotonic() + 60
    while "rank 0 joins the process group" not in snap.log(job, 0):
        assert time.monotonic() < deadline, snap.log(job, 0)
        time.sleep(0.2)
    time.sleep(2)  # connected to the job's store: now in the gloo set-up, waiting for rank 1
    p = snap.run("freeze", job, "--quiesce-timeout", "20", check=False)
    assert p.returncode != 0, p.stdout
    assert "setting up a process group" in p.stderr and "next step:" in p.stderr, p.stderr
    # Rank 1 was still asleep before joining: the refusal came before it joined.
    assert "rank 1 joins the process group" not in snap.log(job, 1)
    final = snap.wait(job, timeout=240)
    assert final["state"] == "SUCCEEDED", (final, snap.log(job, 1)[-2000:])
    ref = tmp_path / "ref.json"
    assert snap.wait(snap.start_job(ref, *ARGS))["state"] == "SUCCEEDED"
    assert read_result(out) == read_result(ref)
