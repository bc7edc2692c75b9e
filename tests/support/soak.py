"""A soak of node agents: many short jobs in a row through the real CLI, with freezes, thaws,
a killed rank and refused freezes among them, sampling each agent's resources after every job.

Used by tests/e2e/test_agent_soak.py (CI: 20 jobs on the embedded daemon) and
bench/soak_bench.py (hundreds of jobs, one node and netns nodes). Resources are read from
/proc of the agent processes directly (procutil.resources), not only from what they report.

The schedule of job i (1-based): the first and every 5th are frozen with --stop and thawed
(so the first job already loaded every code path the later ones use), every other 3rd is
frozen and continues; job 7 has a rank killed with SIGKILL (the job fails), and after jobs 4
and 11 a freeze of the finished job is refused.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter.procutil import Resources, resources
from tests.support.cli import SnapCli

JOB_ARGS = ("--steps", "30", "--step-sleep", "0.02", "--workers", "1")
# A job that is frozen must still run when the freeze reaches it: 75 steps after step 5 at
# 0.03 s were 2.3 s, which the first freeze of a fresh daemon on a loaded machine overran
# (the job ended first and the freeze failed). Pacing changes nothing the job computes.
FREEZE_JOB_ARGS = ("--steps", "80", "--step-sleep", "0.1", "--workers", "1")
KILL_AT = 7
REFUSE_AFTER = (4, 8)


@dataclass(frozen=True)
class Sample:
    job: int  # jobs completed when taken
    t: float  # seconds since the soak started
    by_agent: Mapping[str, Resources]


@dataclass
class SoakReport:
    samples: list[Sample] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.outcomes[what] = self.outcomes.get(what, 0) + 1

    def series(self, agent: str, metric: str) -> list[tuple[int, float]]:
        return [(s.job, float(getattr(s.by_agent[agent], metric))) for s in self.samples]

    def slope(self, agent: str, metric: str, skip: int = 1) -> float:
        """Least-squares growth of `metric` per job over the samples after the first `skip`."""
        pts = self.series(agent, metric)[skip:]
        if len(pts) < 2:
            return 0.0
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0


def rank_process(init_pid: int) -> int | None:
    """The rank (the sandbox init's child), as the host sees it."""
    try:
        kids = Path(f"/proc/{init_pid}/task/{init_pid}/children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None


class Soak:
    """Runs the schedule on `cli`; `agents()` names every agent process to sample (name ->
    pid); `nodes_args` are extra `run` arguments (multi-node placement)."""

    def __init__(
        self,
        cli: SnapCli,
        out_dir: Path,
        agents: Callable[[], Mapping[str, int]],
        start: Callable[[Path, tuple[str, ...]], str] | None = None,
        thaw_args: tuple[str, ...] = (),
    ) -> None:
        self.cli = cli
        self.out_dir = out_dir
        self.agents = agents
        self._start = start or (lambda out, args: cli.start_job(out, *args))
        self.thaw_args = thaw_args
        self.report = SoakReport()
        self._t0 = time.monotonic()

    def sample(self, job: int) -> Sample:
        s = Sample(
            job=job,
            t=time.monotonic() - self._t0,
            by_agent={name: resources(pid) for name, pid in self.agents().items()},
        )
        self.report.samples.append(s)
        return s

    def run(self, n_jobs: int, on_job: Callable[[int, Sample], None] | None = None) -> SoakReport:
        for i in range(1, n_jobs + 1):
            self.one(i)
            s = self.sample(i)
            if on_job is not None:
                on_job(i, s)
        return self.report

    def one(self, i: int) -> None:
        out = self.out_dir / f"job-{i}.json"
        stop_thaw = i == 1 or i % 5 == 0
        freezes = stop_thaw or i % 3 == 0
        # The rank killed must still be running when the kill reaches it: 27 steps at 0.02 s
        # after step 3 were over before `snapshotter status` answered on a loaded CI machine.
        job = self._start(out, FREEZE_JOB_ARGS if freezes or i == KILL_AT else JOB_ARGS)
        self.report.count("launched")
        if i == KILL_AT:
            self._kill_a_rank(job)
            return
        if stop_thaw:
            self.cli.wait_step(job, 5)
            snap = self._freeze(job, "--stop")
            job = self._thaw(snap)
        elif i % 3 == 0:
            self.cli.wait_step(job, 5)
            self._freeze(job)
        st = self.cli.wait(job, timeout=300)
        assert st["state"] == "SUCCEEDED", (
            f"job {i} ({job}) ended {st['state']}: {st}\n{self.diagnose(job, st)}"
        )
        assert json.loads(out.read_text())["steps"] > 0
        self.report.count("succeeded")
        if i in REFUSE_AFTER:
            p = self.cli.run("freeze", job, check=False)
            assert p.returncode == 5, f"freeze of finished job {job}: {p.returncode} {p.stderr}"
            self.report.count("refused")

    def _freeze(self, job: str, *extra: str) -> str:
        p = self.cli.run("freeze", job, *extra, timeout=300)
        self.report.count("frozen")
        return p.stdout.strip().splitlines()[-1]

    def _thaw(self, snap: str) -> str:
        p = self.cli.run("thaw", snap, *self.thaw_args, timeout=300)
        self.report.count("thawed")
        return p.stdout.strip().splitlines()[-1]

    def _kill_a_rank(self, job: str) -> None:
        self.cli.wait_step(job, 3)
        st = self.cli.json("status", job)
        init = next(r["pid"] for r in st["ranks"] if r["rank"] == 1)
        rank = rank_process(init)
        assert rank is not None, f"no rank process under sandbox init {init}"
        os.kill(rank, signal.SIGKILL)
        st = self.cli.wait(job, timeout=120)
        assert st["state"] == "FAILED", f"job {job} with a killed rank ended {st['state']}"
        codes = {r["rank"]: r["exit_code"] for r in st["ranks"]}
        assert codes[1] == 128 + signal.SIGKILL, codes
        self.report.count("rank_killed")

    def diagnose(self, job: str, st: dict[str, Any]) -> str:
        """What a person needs to see about a job that did not end as it should: the state
        of every process of its sandboxes, and the tail of each rank's log."""
        out = []
        for r in st.get("ranks", []):
            pids = [r["pid"]]
            child = rank_process(r["pid"])
            while child is not None:
                pids.append(child)
                child = rank_process(child)
            for pid in pids:
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text().split()
                    wchan = Path(f"/proc/{pid}/wchan").read_text()
                    out.append(f"rank {r['rank']} pid {pid}: state {stat[2]} wchan {wchan}")
                except OSError:
                    out.append(f"rank {r['rank']} pid {pid}: gone")
            try:
                tail = self.cli.log_path(job, r["rank"]).read_text(errors="replace")[-1500:]
            except OSError:
                tail = "(no log)"
            out.append(f"--- rank {r['rank']} log tail:\n{tail}")
        for log in sorted(self.cli.home.glob("*.log")):
            out.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def settle(self, timeout: float = 30.0) -> Sample:
        """Wait until no agent has children or zombies left (they are reaped within the
        agents' housekeeping interval), then sample."""
        deadline = time.monotonic() + timeout
        while True:
            now = {name: resources(pid) for name, pid in self.agents().items()}
            quiet = all(r.children == 0 and r.zombies == 0 for r in now.values())
            if quiet or time.monotonic() > deadline:
                return self.sample(len(self.report.samples))
            time.sleep(0.5)


def leftovers(home: Path) -> dict[str, list[str]]:
    """Per-operation leftovers under an agent's SNAPSHOTTER_HOME that must not exist once
    every job ended: staging/work dirs, init dirs, orphan records."""
    out: dict[str, list[str]] = {}
    for sub in ("work", "sandbox", "sandboxes"):
        d = home / sub
        out[sub] = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
    return out


def describe(r: Resources) -> dict[str, Any]:
    return {k: v for k, v in r.to_dict().items() if k != "pid"}
