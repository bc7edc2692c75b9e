"""The job keeps running by itself (real CRIU, real ranks, the embedded daemon):

- a snapshot policy takes snapshots on schedule and retention keeps K of them;
- kill -9 of a rank under --recover auto: thawed from its newest snapshot, finished with the
  parameters of an uninterrupted run, the recovery reported as an event;
- a rank stopped with SIGSTOP (a hang): named within the deadline and recovered;
- a bug that comes back after every thaw: given up after K recoveries, with the traceback;
- SIGTERM to a foreground `run` (preemption): frozen and stopped within the grace period; the
  snapshot thaws bit-identically.

One daemon serves every case (module fixture): start-up is paid once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import skip_without_criu
from tests.support.cli import POLL_S, ROOT, TRAIN, SnapCli, read_result
from tests.support.disk import shed_bulk
from tests.support.soak import rank_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
STEPS = "400"
# No DataLoader workers: a third of the bytes to freeze (the digest does not depend on them;
# workers are frozen and thawed in test_freeze_thaw).
PACE = ("--step-sleep", "0.1", "--workers", "0")


@pytest.fixture(scope="module")
def cli(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SnapCli]:
    skip_without_criu()
    home = tmp_path_factory.mktemp("resilience")
    c = SnapCli(home, {"SNAPSHOTTER_SUPERVISE_S": "0.5"})
    try:
        c.run("jobs")  # the daemon starts here, in the module's scope, not in a test's
        yield c
    finally:
        c.close()
        shed_bulk(home)


@pytest.fixture(scope="module")
def reference(cli: SnapCli, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of an uninterrupted run (the same job and flags, no failure)."""
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    job = cli.start_job(out, "--steps", STEPS)
    assert cli.wait(job)["state"] == "SUCCEEDED"
    return str(read_result(out)["digest"])


def _events(cli: SnapCli, job: str) -> list[dict[str, Any]]:
    evs: list[dict[str, Any]] = cli.json("events", job)["events"]
    return evs


def _until(what: str, cond: Callable[[], Any], timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _rank(cli: SnapCli, job: str, rank: int) -> int:
    init = next(r["pid"] for r in cli.json("status", job)["ranks"] if r["rank"] == rank)
    pid = rank_process(init)
    assert pid is not None, f"rank {rank} of {job} has no process"
    return pid


def _run(cli: SnapCli, out: Path, *flags: str, train: tuple[str, ...] = ()) -> str:
    p = cli.run("run", "--detach", "--nproc-per-node", "2", *flags, str(TRAIN),
                "--out", str(out), "--steps", STEPS, *PACE, *train)  # fmt: skip
    return p.stdout.strip().splitlines()[-1]


def _signalled_at_step(
    cli: SnapCli, argv: list[str], job: str, step: int, sig: signal.Signals,
    env: dict[str, str] | None = None, before: Callable[[], None] | None = None,
) -> tuple[subprocess.Popen[str], str, str]:
    """Run `argv` in the foreground, send it `sig` once `job` reached `step` (`before` runs
    just before the signal); the process and its output once it ended."""
    proc = subprocess.Popen(argv, env=env or cli.env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        cli.wait_step(job, step)
        if before is not None:
            before()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, stdout, stderr


def test_policy_snapshots_retention_and_recovery_of_a_killed_rank(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    job = _run(cli, out, "--snapshot-every", "5s", "--keep", "2", "--recover", "auto",
               train=("--step-sleep", "0.15"))  # fmt: skip
    st = cli.json("status", job)
    assert st["policy"]["every_s"] == 5.0 and st["policy"]["keep"] == 2
    assert st["recovery"]["mode"] == "auto"

    def snaps() -> list[dict[str, Any]]:
        return [e for e in _events(cli, job) if e["kind"] == "snapshot"]

    _until("three policy snapshots", lambda: len(snaps()) >= 3)
    kept = cli.json("list", "--job", job)["snapshots"]
    taken = {e["snapshot_id"] for e in snaps()}
    # Retention: only the newest 2 remain, every one of them a policy snapshot.
    assert 1 <= len(kept) <= 2, kept
    assert {s["snapshot_id"] for s in kept} <= taken
    assert any(e["kind"] == "expired" for e in _events(cli, job))
    shown = cli.json("policy", "show", job)
    assert shown["interval_s"] == 5.0 and "every 5s" in shown["describe"]

    # The kill must find the job running: three snapshots may take long on a loaded node
    # (each stalls the job and its upload slows it), so this job steps slower than the others
    # (the digest does not depend on the pace).
    step = cli.last_step(job)
    state = cli.json("status", job)["state"]
    assert state in ("RUNNING", "FREEZING") and step < int(STEPS), (
        f"the job is {state} at step {step} after three policy snapshots: "
        f"{[(e['kind'], e.get('detail', '')) for e in _events(cli, job)]}"
    )  # fmt: skip
    killed_at = time.time()
    os.kill(_rank(cli, job, 1), signal.SIGKILL)
    recovered = _until("the recovery", lambda: [e for e in _events(cli, job)
                                                 if e["kind"] == "recovered"])  # fmt: skip
    final = cli.wait(job)
    assert final["state"] == "SUCCEEDED", final
    assert read_result(out)["digest"] == reference
    evs = _events(cli, job)
    failure = next(e for e in evs if e["kind"] == "failure")
    assert failure["cause"] == "rank_signal" and failure["rank"] == 1, failure
    assert failure["time"] - killed_at < 10  # detected within a few supervisor ticks
    # From a policy snapshot (maybe one taken after those above, before the kill).
    taken = {e["snapshot_id"] for e in evs if e["kind"] == "snapshot"}
    assert recovered[0]["snapshot_id"] in taken and recovered[0]["took_s"] > 0
    # The same node: thawed from the copy it kept of that snapshot, nothing fetched.
    assert "verified local copy on" in recovered[0]["detail"], recovered[0]
    # Where the recovery's time went, phase by phase.
    phases = re.search(r"stop \d+\.\ds, thaw \d+\.\ds \(fetch \d+\.\ds, restore \d+\.\ds, "
                       r"resume \d+\.\ds\)", recovered[0]["detail"])  # fmt: skip
    assert phases, recovered[0]
    assert final["recoveries"] == 1
    print(f"\n[resilience] killed at step {step} after three policy snapshots; kill -9 "
          f"detected after {failure['time'] - killed_at:.2f}s, "
          f"recovered in {recovered[0]['took_s']:.2f}s ({phases.group(0)}), steps lost "
          f"{recovered[0].get('steps_lost')}")  # fmt: skip


def test_a_bug_after_every_thaw_is_given_up_with_its_traceback(
    cli: SnapCli, tmp_path: Path
) -> None:
    bug = ("--crash-at", "150", "--crash-rank", "1")
    job = _run(cli, tmp_path / "out.json", "--snapshot-every", "5s", "--recover", "auto",
               "--max-recoveries", "2", train=bug)  # fmt: skip
    final = cli.wait(job, timeout=600)
    assert final["state"] == "FAILED", final
    assert final["exit_code"] != 0
    kinds = [e["kind"] for e in _events(cli, job)]
    assert kinds.count("recovered") == 2, kinds
    assert kinds[-1] == "gave_up", kinds
    assert "injected bug at step 150 on rank 1" in final["gave_up"], final["gave_up"]
    assert "Traceback (most recent call last)" in final["gave_up"]
    ranks = {r["rank"]: r for r in cli.json("status", job)["ranks"]}
    assert "injected bug at step 150 on rank 1" in ranks[1]["error"], ranks  # its @record's
    p = cli.run("status", job)
    assert "recovery stopped" in p.stdout and "injected bug" in p.stdout


def test_sigterm_to_a_foreground_run_freezes_and_stops_it(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    fg, stdout, stderr = _signalled_at_step(
        cli, [sys.executable, "-m", "snapshotter", "run", "--nproc-per-node", "2", "--job-id",
              "preempted", "--preempt-grace", "30", str(TRAIN), "--out", str(out), "--steps",
              STEPS, *PACE], "preempted", 40, signal.SIGTERM)  # fmt: skip
    assert fg.returncode == 0, stderr
    assert "frozen and stopped" in stdout, stdout[-2000:]
    sid = stdout.strip().splitlines()[-1]
    assert cli.json("status", "preempted")["state"] == "FROZEN"
    assert cli.json("thaw", sid)["job_id"] == "preempted"
    assert cli.wait("preempted")["state"] == "SUCCEEDED"
    assert read_result(out)["digest"] == reference


SLURM = ROOT / "deploy" / "slurm" / "snapshotter-slurm"
STUB_SCONTROL = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/scontrol.calls"
"""


def test_slurm_usr1_freezes_requeues_and_the_requeued_job_thaws(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    """deploy/slurm/snapshotter-slurm as a batch script runs it: Slurm's --signal=B:USR1 (a
    real USR1 to the wrapper's process) freezes and stops the job, the wrapper asks scontrol
    (a stub: Slurm is not installed here) to requeue it; the requeued start thaws the newest
    snapshot and the run ends with the parameters of an uninterrupted one."""
    out = tmp_path / "out.json"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(STUB_SCONTROL)
    scontrol.chmod(0o755)
    env = {**cli.env, "SLURM_JOB_ID": "4242", "SCONTROL": str(scontrol),
           "SNAPSHOTTER": str(Path(sys.executable).parent / "snapshotter")}  # fmt: skip
    argv = [str(SLURM), "--nproc-per-node", "2", "--preempt-grace", "60", str(TRAIN), "--out",
            str(out), "--steps", STEPS, *PACE]  # fmt: skip
    batch, stdout, stderr = _signalled_at_step(cli, argv, "slurm-4242", 40, signal.SIGUSR1, env)
    assert batch.returncode == 0, stderr
    assert "frozen and stopped" in stdout and "requeueing Slurm job 4242" in stderr, stderr
    assert (tmp_path / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]
    assert cli.json("status", "slurm-4242")["state"] == "FROZEN"
    # Slurm starts the batch script again (SLURM_RESTART_COUNT=1): the same command resumes.
    again = subprocess.run(argv, env={**env, "SLURM_RESTART_COUNT": "1"}, cwd=ROOT,
                           capture_output=True, text=True, timeout=400)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "resuming job slurm-4242 from its newest snapshot" in again.stderr, again.stderr
    assert cli.json("status", "slurm-4242")["state"] == "SUCCEEDED"
    assert read_result(out)["digest"] == reference
    assert (tmp_path / "scontrol.calls").read_text().splitlines() == ["requeue 4242"]


def test_the_slurm_wrapper_outside_slurm_says_what_to_do(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    p = subprocess.run([str(SLURM), str(TRAIN)], env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "SLURM_JOB_ID is not set" in p.stderr and "next:" in p.stderr


def test_ctrl_c_stops_a_foreground_run(cli: SnapCli, tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the foreground `run`) stops the job's ranks, as torchrun does; it is
    not left running behind the terminal. torchrun's output flags route the ranks' output:
    --tee 3 into --log-dir (torchrun's layout), --local-ranks-filter 0 on the console."""
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "snapshotter", "run", "--nproc-per-node", "2", "--job-id",
            "interrupted", "--log-dir", str(logs), "--tee", "3", "--local-ranks-filter", "0",
            str(TRAIN), "--out", str(tmp_path / "out.json"), "--steps", STEPS, *PACE]  # fmt: skip
    ranks: list[int] = []

    def at_step_20() -> None:
        ranks.extend(_rank(cli, "interrupted", r) for r in (0, 1))

    fg, stdout, stderr = _signalled_at_step(cli, argv, "interrupted", 20, signal.SIGINT,
                                            before=at_step_20)  # fmt: skip
    assert fg.returncode == 130, stderr
    assert "interrupted: stopping job interrupted" in stderr and "Traceback" not in stderr
    assert cli.json("status", "interrupted")["state"] == "CANCELLED"
    assert ranks and not any(_pid_running(pid) for pid in ranks), ranks
    assert "rank 0 step 20 " in stdout and "rank 1 " not in stdout, stdout[-2000:]
    for r in (0, 1):
        text = (logs / "interrupted" / "attempt_0" / str(r) / "stdout.log").read_text()
        assert f"rank {r} step 20 " in text, text[-2000:]
    tail = cli.run("logs", "interrupted", "--tail", "2").stdout.splitlines()
    assert [line[:9] for line in tail] == ["[rank0]: "] * 2 + ["[rank1]: "] * 2, tail


def _pid_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_freeze_and_thaw_on_a_terminal_draw_progress_bars(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    """`freeze --stop` and `thaw` under a pseudo-terminal (`script`): rich bars with bytes,
    percent and rate for the upload and for the thaw's fetch; the thawed job ends as an
    uninterrupted one."""
    out = tmp_path / "out.json"
    job = _run(cli, out)
    cli.wait_step(job, 20)

    def on_a_terminal(*args: str) -> str:
        cmd = shlex.join([sys.executable, "-m", "snapshotter", *args])
        p = subprocess.run(["script", "-qfec", cmd, "/dev/null"], cwd=ROOT, capture_output=True,
                           text=True, timeout=300,
                           env={**cli.env, "TERM": "xterm-256color", "COLUMNS": "120"})  # fmt: skip
        screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", p.stdout)
        assert p.returncode == 0, screen[-3000:]
        return screen

    frozen = on_a_terminal("freeze", job, "--stop")
    assert re.search(r"upload \S+ +━+.* 100% .*GiB|upload \S+ +━+.* 100% .*MiB", frozen), frozen
    assert "] dump" in frozen and "committed" in frozen, frozen[-3000:]
    (snap,) = [s["snapshot_id"] for s in cli.json("list", "--job", job)["snapshots"]]
    thawed = on_a_terminal("thaw", snap)
    assert re.search(r"fetch \S+ +━+.* 100% ", thawed), thawed[-3000:]
    # `logs --follow` of every rank: prefixed lines as they come, until the job ends.
    follow = subprocess.run([sys.executable, "-m", "snapshotter", "logs", job, "--follow"],
                            env=cli.env, cwd=ROOT, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert cli.wait(job)["state"] == "SUCCEEDED"
    assert read_result(out)["digest"] == reference
    lines = follow.stdout.splitlines()
    assert follow.returncode == 0 and lines, follow.stderr
    assert all(re.match(r"\[rank[01]\]: ", line) for line in lines), lines[:5]
    assert any(line.startswith("[rank1]: rank 1 done steps") for line in lines), lines[-5:]


def test_flags_are_checked_before_anything_starts(cli: SnapCli) -> None:
    for flags, needle in (
        (("--snapshot-every", "2s"), "--snapshot-every"),
        (("--snapshot-every", "soon"), "--snapshot-every"),
        (("--keep", "0"), "--keep"),
        (("--spares", "n1"), "--recover auto"),
        (("--recover", "auto", "--hang-deadline", "-3"), "--hang-deadline"),
    ):
        p = cli.run("run", "--detach", *flags, str(TRAIN), check=False)
        assert p.returncode == 2, (flags, p.stderr)
        assert needle in p.stderr and "Traceback" not in p.stderr, (flags, p.stderr)
    p = cli.run("policy", "set", "no-such-job", "--keep", "3", check=False)
    assert p.returncode != 0 and "no-such-job" in p.stderr and "Traceback" not in p.stderr
    running = [j for j in json.loads(cli.run("jobs", "--json").stdout)["jobs"]
               if j["state"] == "RUNNING"]  # fmt: skip
    assert running == []  # nothing was started by a refused run


def test_a_stopped_rank_is_a_hang_named_within_the_deadline_and_recovered(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    job = _run(cli, out, "--snapshot-every", "5s", "--recover", "auto", "--hang-deadline", "8")
    _until("a policy snapshot",
           lambda: any(e["kind"] == "snapshot" for e in _events(cli, job)))  # fmt: skip
    stopped_at = time.time()
    os.kill(_rank(cli, job, 1), signal.SIGSTOP)
    failure = _until("the hang", lambda: next(
        (e for e in _events(cli, job) if e["kind"] == "failure"), None))  # fmt: skip
    assert failure["cause"] == "hang" and failure["rank"] == 1, failure
    took = failure["time"] - stopped_at
    assert 8 <= took < 30, took  # not before the deadline; soon after it
    final = cli.wait(job)
    assert final["state"] == "SUCCEEDED", final
    assert read_result(out)["digest"] == reference
    assert [e["kind"] for e in _events(cli, job)].count("recovered") == 1
    print(f"\n[resilience] SIGSTOP detected as a hang after {took:.2f}s (deadline 8s)")


def test_a_rank_stopped_while_a_policy_freeze_parks_is_a_hang_named_soon(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    """SIGSTOP of rank 1 while a policy freeze waits for it to park (the job is in a phase
    without collectives): the freeze gives up within the hang deadline, not the park's 60 s
    (then 30 s more on the stopped rank's abort), and the hang is named and recovered."""
    out = tmp_path / "out.json"
    job = _run(cli, out, "--recover", "auto", "--hang-deadline", "20",
               train=("--pause-at", "50", "--pause-s", "14"))  # fmt: skip
    cli.wait_step(job, 50)  # rank 0 printed step 50: both ranks are in the pause now
    cli.run("policy", "set", job, "--snapshot-every", "5s")  # the shortest interval
    _until("the policy freeze", lambda: cli.json("status", job)["state"] == "FREEZING",
           timeout=10)  # fmt: skip
    assert cli.last_step(job, 1) == 50, "rank 1 left the pause before it was stopped"
    stopped_at = time.time()
    os.kill(_rank(cli, job, 1), signal.SIGSTOP)
    failure = _until("the hang", lambda: next(
        (e for e in _events(cli, job) if e["kind"] == "failure"), None))  # fmt: skip
    took = failure["time"] - stopped_at
    assert failure["cause"] == "hang" and failure["rank"] == 1, failure
    assert took < 45, took  # the park's timeout alone was 60 s
    failed = [e for e in _events(cli, job) if e["kind"] == "snapshot_failed"]
    assert failed and "did not reach collective barrier" in failed[0]["detail"], failed
    cli.run("policy", "clear", job, check=False)  # (once recovered, nothing more to show)
    final = cli.wait(job)
    assert final["state"] == "SUCCEEDED", final
    assert read_result(out)["digest"] == reference
    print(f"\n[resilience] SIGSTOP during a policy freeze's park named as a hang after "
          f"{took:.2f}s (deadline 20s)")


def _daemon(cli: SnapCli) -> int:
    return int(json.loads((cli.home / "daemon.json").read_text())["pid"])


def _restarted(cli: SnapCli, old: int) -> None:
    _until("the daemon's restart", lambda: (cli.home / "daemon.json").exists()
           and _daemon(cli) != old and cli.run("jobs", check=False).returncode == 0)  # fmt: skip


def test_a_killed_daemon_never_costs_the_job(
    snap: SnapCli, reference: str, tmp_path: Path
) -> None:
    """kill -9 of the embedded daemon while the job trains, then during a freeze's dump (the
    ranks suspended, their communicators torn down), then during its upload: the job trains
    on each time, the restarted agent re-adopts it (resuming the ranks its predecessor left
    suspended), and a later freeze and thaw succeed bit-identically. (Its own daemon: the
    restarted one ends with the test.)"""
    cli = snap
    out = tmp_path / "out.json"
    job = _run(cli, out)
    cli.wait_step(job, 20)
    old = _daemon(cli)
    os.kill(old, signal.SIGKILL)
    _restarted(cli, old)
    assert cli.json("status", job)["state"] == "RUNNING"
    cli.wait_step(job, cli.last_step(job) + 10)  # still training, output still logged

    for phase in ("dump", "upload"):
        freeze = subprocess.Popen(
            [sys.executable, "-m", "snapshotter", "freeze", job], env=cli.env, cwd=ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert freeze.stderr is not None
            for line in freeze.stderr:
                if f"] {phase}" in line:
                    break
            old = _daemon(cli)
            os.kill(old, signal.SIGKILL)
            freeze.communicate(timeout=120)
        finally:
            if freeze.poll() is None:
                freeze.kill()
        assert freeze.returncode != 0
        _restarted(cli, old)
        assert cli.json("status", job)["state"] == "RUNNING"
        cli.wait_step(job, cli.last_step(job) + 10, timeout=120)

    sid = cli.json("freeze", job, "--stop")["snapshot_id"]
    assert cli.json("thaw", sid)["job_id"] == job
    final = cli.wait(job)
    assert final["state"] == "SUCCEEDED", final
    assert read_result(out)["digest"] == reference


def test_drain_freezes_and_stops_the_jobs_of_a_node(
    cli: SnapCli, reference: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.json"
    job = _run(cli, out)
    cli.wait_step(job, 30)
    node = cli.json("status", job)["nodes"][0]
    try:
        res = cli.json("drain", node, "--grace", "60")
        (drained,) = [j for j in res["jobs"] if j["job_id"] == job]
        assert drained["fallback"] is False and drained["snapshot_id"], drained
        assert cli.json("status", job)["state"] == "FROZEN"
        assert any(e["kind"] == "preempted" for e in _events(cli, job))
    finally:
        cli.run("drain", node, "--undo")
    assert cli.json("thaw", drained["snapshot_id"])["job_id"] == job
    assert cli.wait(job)["state"] == "SUCCEEDED"
    assert read_result(out)["digest"] == reference
    p = cli.run("drain", "no-such-node", check=False)
    assert p.returncode == 2 and "no-such-node" in p.stderr and "Traceback" not in p.stderr
