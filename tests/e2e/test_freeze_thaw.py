"""End to end: a real 2-rank gloo DDP job (DataLoader workers, AdamW, dropout), launched by
`snapshotter run` from a script that knows nothing of snapshotter, frozen with real CRIU and
thawed; its final parameters must be bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import skip_without_criu
from tests.support.cli import SnapCli, read_result
from tests.support.disk import shed_bulk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = "240"
ARGS = ("--steps", STEPS, "--step-sleep", "0.03")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The uninterrupted run every test compares against (launched the same way)."""
    skip_without_criu()
    base = tmp_path_factory.mktemp("ref")
    cli = SnapCli(base / "home")
    try:
        job = cli.start_job(base / "ref.json", *ARGS)
        st = cli.wait(job)
        assert st["state"] == "SUCCEEDED", st
        yield read_result(base / "ref.json")
    finally:
        cli.close()
        shed_bulk(base)


def _store_files(home: Path) -> list[str]:
    store = home / "store"
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())


def test_freeze_stop_then_thaw_is_bit_identical(
    snap: SnapCli, tmp_path: Path, reference: dict
) -> None:
    out = tmp_path / "out.json"
    job = snap.start_job(out, *ARGS)
    at = snap.wait_step(job, 60)
    fr = snap.run("freeze", job, "--stop")
    snapshot = fr.stdout.strip().splitlines()[-1]
    st = snap.json("status", job)
    assert st["state"] == "FROZEN"
    frozen_at = snap.last_step(job)
    assert at <= frozen_at < int(STEPS), "the job must have been frozen mid-run"
    assert not out.exists()

    listed = snap.json("list")["snapshots"]
    assert [s["snapshot_id"] for s in listed] == [snapshot]
    shown = snap.json("show", snapshot)
    assert shown["ranks"] == 2 and shown["stored_bytes"] > 0

    th = snap.run("thaw", snapshot)
    assert th.stdout.strip().splitlines()[-1] == job  # the job continues under its own id
    # Thawed where it was frozen: from the node's verified copy, no fetch from the store.
    assert "from their verified local copy" in th.stderr, th.stderr
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == reference
    # The log shows one uninterrupted sequence of steps across the freeze.
    steps = [
        int(line.split()[3])
        for line in snap.log_path(job).read_text().splitlines()
        if line.startswith("rank 0 step ")
    ]
    assert steps == list(range(1, int(STEPS) + 1))


def test_freeze_and_continue_is_bit_identical(
    snap: SnapCli, tmp_path: Path, reference: dict
) -> None:
    out = tmp_path / "out.json"
    job = snap.start_job(out, *ARGS)
    snap.wait_step(job, 40)
    res = snap.json("freeze", job)
    assert res["stopped"] is False and res["stats"]["stall_s"] is not None
    assert snap.json("status", job)["state"] in ("RUNNING", "SUCCEEDED")
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == reference
    assert res["snapshot_id"] in [s["snapshot_id"] for s in snap.json("list")["snapshots"]]
    # Where the freeze's time went, per node and rank, as text and as a Chrome trace.
    assert {"finish", "resume"} <= {sp["phase"] for sp in res["stats"]["spans"]}
    chart = snap.run("show", res["snapshot_id"], "--timeline").stdout
    for phase in ("prepare", "park", "suspend", "dump", "resume", "upload", "commit"):
        assert f" {phase} " in chart, chart
    assert "  rank 0 " in chart and "  rank 1 " in chart, chart
    snap.run("show", res["snapshot_id"], "--trace", str(tmp_path / "f.json"))
    xs = [e for e in json.loads((tmp_path / "f.json").read_text())["traceEvents"]
          if e["ph"] == "X"]  # fmt: skip
    assert sorted(e["args"]["rank"] for e in xs if e["name"] == "dump" and e["tid"]) == [0, 1]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in xs)


def test_thaw_a_fork_while_the_original_runs(
    snap: SnapCli, tmp_path: Path, reference: dict
) -> None:
    out = tmp_path / "out.json"
    # Paced (the digest does not depend on it: see test_fork_with_live_persistent_workers...)
    # so that the original still runs when the fork is thawed, however busy the machine: a
    # thaw of a snapshot whose job has finished continues that job instead of forking it.
    job = snap.start_job(out, "--steps", STEPS, "--step-sleep", "0.2")
    snap.wait_step(job, 40)
    snapshot = snap.run("freeze", job).stdout.strip().splitlines()[-1]
    # The node's copy of the snapshot is damaged (one bit of a page image, its times put
    # back): the thaw must notice, fetch from the store instead, and still be exact.
    page = max((snap.home / "copies" / job / snapshot).rglob("pages-*.img"),
               key=lambda p: p.stat().st_size)  # fmt: skip
    before = page.stat()
    with open(page, "r+b") as f:
        f.seek(before.st_size // 2)
        b = f.read(1)
        f.seek(before.st_size // 2)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(page, ns=(before.st_atime_ns, before.st_mtime_ns))
    # The fork is the same process image, so it writes the same --out path: check the
    # original's result first, then the fork's.
    th = snap.run("thaw", snapshot)
    assert "local copy" not in th.stderr, th.stderr
    assert not (snap.home / "copies" / job / snapshot).exists()  # the damaged copy is gone
    fork = th.stdout.strip().splitlines()[-1]
    assert fork != job and fork.startswith(job)
    st = snap.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == reference
    out.unlink()
    st = snap.wait(fork)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == reference
    # Each job kept its own log; the fork's continues after the freeze point.
    fork_steps = [
        ln for ln in snap.log_path(fork).read_text().splitlines() if ln.startswith("rank 0 step ")
    ]
    assert fork_steps and fork_steps[-1].startswith(f"rank 0 step {STEPS} ")


def test_delete_makes_snapshot_invisible(snap: SnapCli, tmp_path: Path) -> None:
    job = snap.start_job(tmp_path / "o.json", *ARGS)
    snap.wait_step(job, 20)
    snapshot = snap.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    assert any(snapshot in f for f in _store_files(snap.home))
    snap.run("delete", snapshot)
    assert snap.json("list")["snapshots"] == []
    assert not any(snapshot in f for f in _store_files(snap.home))
    p = snap.run("thaw", snapshot, check=False)
    assert p.returncode == 3 and "no committed snapshot" in p.stderr


def test_fork_with_live_persistent_workers_and_private_tmp(
    tmp_path: Path, make_snap: Callable[..., SnapCli]
) -> None:
    """Persistent DataLoader workers keep their multiprocessing listeners for the whole run, so
    a fork thawed on the same node overlaps them; every sandbox has its own TMPDIR (the
    default, said explicitly here) and both jobs finish as an undisturbed run does."""
    args = ("--steps", "600", "--persistent-workers")
    cli = make_snap({"SNAPSHOTTER_PRIVATE_TMP": "1"})
    ref = tmp_path / "ref.json"
    assert cli.wait(cli.start_job(ref, *args))["state"] == "SUCCEEDED"
    out = tmp_path / "out.json"
    # Paced (the digest does not depend on it) so that the original still runs when the fork
    # is thawed, however busy the machine.
    job = cli.start_job(out, *args, "--step-sleep", "0.1")
    cli.wait_step(job, 40)
    snapshot = cli.run("freeze", job).stdout.strip().splitlines()[-1]
    fork = cli.run("thaw", snapshot).stdout.strip().splitlines()[-1]
    assert cli.json("status", job)["state"] == "RUNNING"  # both live at once
    assert cli.wait(job)["state"] == "SUCCEEDED"
    assert cli.wait(fork)["state"] == "SUCCEEDED"
    # Both write the same --out (the fork inherits the arguments), in either order on a busy
    # machine: each one's own final digest is the line its rank 0 logged.
    assert read_result(out) == read_result(ref)
    want = read_result(ref)["digest"]
    for j in (job, fork):
        done = [ln for ln in cli.log_path(j).read_text().splitlines() if " done steps " in ln]
        assert done and done[-1].endswith(f"digest {want}"), (j, done[-3:])


def test_a_format_1_snapshot_thaws_after_the_upgrade(
    make_snap: Callable[..., SnapCli], tmp_path: Path, reference: dict
) -> None:
    """Frozen by agents that write format 1 (per-snapshot chunks: what a release before the
    shared chunks wrote), thawed after the upgrade by agents that write format 2: bit-identical,
    through the store (the node's local copy removed)."""
    # A release before the shared chunks had no encryption at rest either.
    old = make_snap({"SNAPSHOTTER_FORMAT_VERSION": "1", "SNAPSHOTTER_ENCRYPT": "0"})
    out = tmp_path / "out.json"
    job = old.start_job(out, *ARGS)
    old.wait_step(job, 60)
    snapshot = old.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    files = _store_files(old.home)
    assert any(f.startswith(f"snapshots/{snapshot}/chunks/") for f in files)
    assert not any(f.startswith("chunks/") for f in files)
    old.run("down", "--force")
    shutil.rmtree(old.home / "copies", ignore_errors=True)
    new = SnapCli(old.home)
    try:
        th = new.run("thaw", snapshot, "--job-id", "upgraded")
        thawed = th.stdout.strip().splitlines()[-1]
        assert "from their verified local copy" not in th.stderr, th.stderr
        st = new.wait(thawed)
        assert st["state"] == "SUCCEEDED", st
        assert read_result(out) == reference
    finally:
        new.close()


def test_an_encrypted_snapshot_keeps_no_plaintext_of_the_job_in_the_store(
    make_snap: Callable[..., SnapCli], tmp_path: Path, reference: dict
) -> None:
    """Encryption at rest, on by default: a marker only the ranks' memory holds (their
    environment, and os.environ's copy on the heap; the snapshot's meta keeps no such variable)
    is in no stored byte; the snapshot is sealed under the job's tenant's data key, which stays
    in the coordinator's keys/ and never in the store; and the job thaws bit-identical from the
    store (the node's local copy removed)."""
    marker = "SNAPSHOT-SECRET-" + secrets.token_hex(8)
    # Uncompressed chunks: only the encryption stands between the marker and the store.
    cli = make_snap({"JOB_SECRET": marker, "SNAPSHOTTER_CODEC": "none"})
    out = tmp_path / "out.json"
    job = cli.start_job(out, *ARGS, tenant="acme")
    cli.wait_step(job, 40)
    pids = cli.rank_pids()
    assert pids and all(marker.encode() in Path(f"/proc/{p}/environ").read_bytes() for p in pids)
    snapshot = cli.run("freeze", job, "--stop").stdout.strip().splitlines()[-1]
    assert cli.json("status", job)["state"] == "FROZEN"
    store = cli.home / "store"
    files = [p for p in store.rglob("*") if p.is_file()]
    assert any(p.parts[-3] == "chunks" for p in files)
    leaked = [str(p.relative_to(store)) for p in files if marker.encode() in p.read_bytes()]
    assert leaked == []
    manifest = json.loads((store / "snapshots" / snapshot / "manifest.json").read_text())
    key_id = manifest["sealed"]["key_id"]
    assert manifest["version"] == 3 and manifest["sealed"]["tenant"] == "acme"
    wrapped = cli.home / "keys" / "data" / "acme" / f"{key_id}.wrapped"
    assert wrapped.exists() and not any(wrapped.read_bytes() in p.read_bytes() for p in files)
    shutil.rmtree(cli.home / "copies", ignore_errors=True)
    th = cli.run("thaw", snapshot)
    assert "from their verified local copy" not in th.stderr, th.stderr
    st = cli.wait(job)
    assert st["state"] == "SUCCEEDED", st
    assert read_result(out) == reference
