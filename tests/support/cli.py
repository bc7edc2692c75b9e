"""Drives the real `snapshotter` CLI against an isolated embedded daemon, for end-to-end tests.

Each `SnapCli` has its own SNAPSHOTTER_HOME, so its daemon, jobs, logs and local store are its
own. `close()` stops the daemon and every rank it started, by pid, also when a test failed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_ddp.py"
# Between polls that run the CLI: each call is a Python process (about 0.6 s of CPU here), and
# a loop polling faster took most of a core from the jobs under test.
POLL_S = 1.0
TRACE = os.environ.get("SNAPSHOTTER_TEST_TRACE") == "1"


class SnapCli:
    def __init__(self, home: Path, extra_env: dict[str, str] | None = None) -> None:
        self.home = home
        self.env = dict(os.environ)
        self.env.update({"SNAPSHOTTER_HOME": str(home), "PYTHONUNBUFFERED": "1"})
        self.env.pop("SNAPSHOTTER_COORDINATOR", None)
        self.env.pop("SNAPSHOTTER_STORE", None)
        if extra_env:
            self.env.update(extra_env)
        self._pids: set[int] = set()
        self._keepers: set[int] = set()

    def run(
        self, *args: str, check: bool = True, timeout: float = 300, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "snapshotter", *args],
            env=self.env,
            cwd=cwd or ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self._remember()
        if TRACE:  # SNAPSHOTTER_TEST_TRACE=1: where a slow test's time goes
            print(f"[cli {time.monotonic() - t0:6.1f}s] {' '.join(args)[:100]}", file=sys.stderr)
        if check and p.returncode != 0:
            raise AssertionError(
                f"snapshotter {' '.join(args)} exited {p.returncode}\n"
                f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
            )
        return p

    def json(self, *args: str, check: bool = True, timeout: float = 300) -> Any:
        p = self.run(*args, "--json", check=check, timeout=timeout)
        return json.loads(p.stdout.strip().splitlines()[-1])

    def start_job(
        self, out: Path, *train_args: str, job_id: str | None = None, nproc: int = 2,
        tenant: str | None = None,
    ) -> str:  # fmt: skip
        args = ["run", "--detach", "--nproc-per-node", str(nproc)]
        if job_id:
            args += ["--job-id", job_id]
        if tenant:
            args += ["--tenant", tenant]
        p = self.run(*args, str(TRAIN), "--out", str(out), *train_args)
        return p.stdout.strip().splitlines()[-1]

    def log_path(self, job: str, rank: int = 0) -> Path:
        return self.home / "jobs" / job / "logs" / f"rank-{rank}.log"

    def log(self, job: str, rank: int = 0) -> str:
        """What the rank has logged so far ("" before its log exists)."""
        try:
            return self.log_path(job, rank).read_text(errors="replace")
        except OSError:
            return ""

    def last_step(self, job: str, rank: int = 0) -> int:
        steps = re.findall(rf"rank {rank} step (\d+) ", self.log(job, rank))
        return int(steps[-1]) if steps else 0

    def wait_step(self, job: str, step: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.last_step(job)
            if s >= step:
                return s
            time.sleep(0.2)
        raise AssertionError(
            f"job {job} did not reach step {step} in {timeout}s; log:\n"
            + (self.log(job)[-3000:] or "(no log)")
        )

    def wait(self, job: str, timeout: float = 300) -> dict[str, Any]:
        st: dict[str, Any] = self.json(
            "wait", job, "--timeout", str(timeout), check=False, timeout=timeout + 60
        )
        return st

    def _daemon_pid(self, which: str = "pid") -> int | None:
        try:
            return int(json.loads((self.home / "daemon.json").read_text())[which])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _remember(self) -> None:
        pid, keeper = self._daemon_pid(), self._daemon_pid("keeper")
        if pid:
            self._pids.add(pid)
        if keeper:
            self._keepers.add(keeper)

    def rank_pids(self) -> list[int]:
        if self._daemon_pid() is None:
            return []
        p = self.run("jobs", "--json", check=False, timeout=60)
        try:
            jobs = json.loads(p.stdout.strip().splitlines()[-1])["jobs"]
        except (ValueError, IndexError, KeyError):
            return []
        return [r["pid"] for j in jobs for r in j["ranks"] if r.get("exit_code") is None]

    def close(self) -> None:
        ranks = self.rank_pids()
        if self._daemon_pid() is not None:
            self.run("down", "--force", check=False, timeout=120)
        deadline = time.monotonic() + 10  # a keeper ends once its daemon stopped cleanly
        while any(_alive(k) for k in self._keepers) and time.monotonic() < deadline:
            time.sleep(0.1)
        # Keepers first: a keeper whose daemon died starts it again.
        for pid in [*self._keepers, *ranks, *self._pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # The node's raw local snapshot copies are the largest thing a test leaves; pytest
        # keeps every test's home until the session ends.
        shutil.rmtree(self.home / "copies", ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def read_result(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.read_text())
    return result


TORCHRUN = Path(sys.executable).with_name("torchrun")


def torchrun_digest(script: Path, out: Path, steps: str, cwd: Path, nproc: int = 2) -> str:
    """The uninterrupted reference: the same script under plain torchrun, no snapshotter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER")}
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(script),
           "--out", str(out), "--steps", steps]  # fmt: skip
    # Plain torchrun, no snapshotter, and still it failed twice on this machine: once a
    # DataLoader worker forked from a rank deadlocked in a lock a gloo thread held at the fork
    # (a hang), once an FSDP2 rank aborted at exit after its last step ("terminate called
    # without an active exception"). Such failures are torch's; one more try tells them from
    # a script that is broken.
    for attempt in (1, 2):
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            output, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            output, _ = p.communicate()
        if p.returncode == 0:
            break
        out.unlink(missing_ok=True)
        if attempt == 2:
            raise AssertionError(
                f"plain torchrun failed twice (exit {p.returncode}): "
                + output.decode(errors="replace")[-3000:]
            )
    digest: str = json.loads(out.read_text())["digest"]
    return digest
