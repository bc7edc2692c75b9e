"""Benchmark: throughput lost under failures, snapshotter against checkpoint-restart.

The same job (examples/train_ddp.py, 2 ranks, with a start-up cost standing for imports, data
preparation and model build) and the same failure schedule (kill -9 of one rank, then of the
whole node's agent and ranks, alternating, evenly spaced over the time (a) trains, after its
start-up: one during start-up costs every method the same), three ways, side by side in one
run:

  (a) plain torchrun, no failures: the time the work takes;
  (b) torchrun with the job's own checkpoints every K steps, once with torch.save by rank 0
      and once with torch.distributed.checkpoint.async_save by every rank (its own gloo
      group; the step waits for staging only), K by Young-Daly from the measured cost to the
      step and the schedule's MTBF; after any failure the job is launched
      again and resumes from its last checkpoint (what a scheduler's requeue does). Not
      torchrun's own --max-restarts: with torch 2.13 here, the workers it restarted after a
      kill -9 of one of them hung in init_process_group (both connected to the store, no
      progress for 15 minutes), which would make (b) look worse than it is;
  (c) snapshotter run --snapshot-every auto --recover auto (the coordinator is told the same
      MTBF as its prior).

Reported: each method's time, lost throughput = 1 - (a)/(method), the ratio (c)/(b) against
the (b) that lost least (target <= 0.15), and the step time of (c) outside freeze and recovery
windows / (a)'s (target <= 1.01).

Usage: python bench/goodput_bench.py [--steps 1500] [--step-sleep 0.1] [--startup-s 120]
       [--failures 3] [--rounds 1] [--b-kinds save,dcp-async] [--json out.json]
The start-up default, 120 s, is short of a large job's (imports, NCCL init, data, model build
and checkpoint load take minutes there) and keeps a round near 15 minutes here.
Needs root and CRIU (deploy/install.sh --with-job-deps).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.cli import TRAIN, SnapCli  # noqa: E402 - the harness tests and bench share
from tests.support.procs import children  # noqa: E402
from tests.support.soak import rank_process  # noqa: E402

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "FROZEN")
STAMP = re.compile(r"rank 0 step (\d+) loss \S+ t=(\d+\.\d+)")


def kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stamps(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(t)) for s, t in STAMP.findall(text)]


def step_time(points: list[tuple[int, float]], exclude: list[tuple[float, float]]) -> float:
    """Median seconds per step between consecutive steps, outside the `exclude` windows."""
    gaps = []
    for (s0, t0), (s1, t1) in zip(points, points[1:], strict=False):
        if s1 != s0 + 1 or any(a <= t1 and t0 <= b for a, b in exclude):
            continue
        gaps.append(t1 - t0)
    return statistics.median(gaps) if gaps else float("nan")


def save_cost(kind: str, work: Path, rounds: int = 5) -> float:
    """What one checkpoint of this job's model and optimizer costs the training loop
    (median): a whole torch.save, or the part of a dcp.async_save the step waits for
    (staging and planning; the write runs in the background, and is waited for here
    between rounds, as the job waits for one save before the next)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "examples"))
    from train_ddp import DcpCheckpoints, make_model  # type: ignore[import-not-found]

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    times = []
    if kind == "save":
        for _ in range(rounds):
            t0 = time.monotonic()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, io.BytesIO())
            times.append(time.monotonic() - t0)
        return statistics.median(times)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ckpt = DcpCheckpoints(str(work / "cost-dcp"), model, opt)
        for i in range(rounds):
            ckpt.finish()
            t0 = time.monotonic()
            ckpt.save(i, 0)
            times.append(time.monotonic() - t0)
        ckpt.finish()
    finally:
        dist.destroy_process_group()
    return statistics.median(times)


def describe(e: dict[str, Any]) -> str:
    """One line for a failure or recovery event of (c)."""
    parts = [f"{e['kind']}: {e.get('detail') or e.get('cause')}"]
    if e.get("took_s") is not None:
        parts.append(f"took {float(e['took_s']):.1f}s")
    if e.get("steps_lost") is not None:
        parts.append(f"{e['steps_lost']} steps lost")
    return ", ".join(parts)


def status_of(cli: SnapCli, job: str) -> dict[str, Any]:
    """The job's status, or {} while the daemon does not answer (it is being restarted)."""
    try:
        out = cli.json("status", job, check=False)
    except (ValueError, IndexError):
        return {}
    return out if isinstance(out, dict) else {}


class Schedule:
    def __init__(self, times: list[float]) -> None:
        self.times = times

    def kinds(self) -> list[str]:
        return ["rank" if i % 2 == 0 else "node" for i in range(len(self.times))]


def torchrun_cmd(args: argparse.Namespace, out: Path, extra: list[str], restarts: int) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", "--max-restarts", str(restarts), str(TRAIN), "--out", str(out), "--steps",
            str(args.steps), "--step-sleep", str(args.step_sleep), "--startup-s",
            str(args.startup_s), "--stamp", *extra]  # fmt: skip


def run_a(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out, logf = work / "a.json", work / "a.log"
    t0 = time.monotonic()
    with open(logf, "w") as f:
        subprocess.run(torchrun_cmd(args, out, [], 0), stdout=f, stderr=subprocess.STDOUT,
                       check=True, cwd=ROOT)  # fmt: skip
    took = time.monotonic() - t0
    return {"time_s": took, "digest": json.loads(out.read_text())["digest"],
            "step_s": step_time(stamps(logf.read_text()), [])}  # fmt: skip


def run_b(
    args: argparse.Namespace, work: Path, sched: Schedule, k: int, kind: str
) -> dict[str, Any]:
    out, logf, ckpt = work / f"b-{kind}.json", work / f"b-{kind}.log", work / f"b-{kind}.ckpt"
    extra = ["--ckpt", str(ckpt), "--ckpt-every", str(k), "--ckpt-kind", kind, "--resume"]
    t0 = time.monotonic()
    pending = list(zip(sched.times, sched.kinds(), strict=True))
    relaunches = 0
    with open(logf, "w") as f:
        proc = subprocess.Popen(torchrun_cmd(args, out, extra, 0), stdout=f,
                                stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
        while True:
            code = proc.poll()
            if code is not None:
                if code == 0:
                    break
                relaunches += 1  # the scheduler requeues the job
                for w in children(proc.pid):
                    kill([w])
                proc = subprocess.Popen(torchrun_cmd(args, out, extra, 0),
                                        stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)  # fmt: skip
            if pending and time.monotonic() - t0 >= pending[0][0]:
                _, what = pending.pop(0)
                workers = children(proc.pid)
                if what == "rank" and workers:
                    kill(workers[-1:])
                else:
                    kill([proc.pid, *workers])
            time.sleep(0.1)
    return {"time_s": time.monotonic() - t0, "digest": json.loads(out.read_text())["digest"],
            "k": k, "kind": kind, "relaunches": relaunches}  # fmt: skip


def run_c(args: argparse.Namespace, work: Path, sched: Schedule, mtbf_s: float) -> dict[str, Any]:
    cli = SnapCli(work / "home", {"SNAPSHOTTER_PRIOR_NODE_MTBF_S": str(mtbf_s)})
    out = work / "c.json"
    try:
        cli.run("jobs")  # the daemon starts before the clock
        t0 = time.monotonic()
        p = cli.run("run", "--detach", "--nproc-per-node", "2", "--snapshot-every", "auto",
                    "--recover", "auto", "--max-recoveries", str(len(sched.times) + 2),
                    str(TRAIN), "--out", str(out), "--steps", str(args.steps),
                    "--step-sleep", str(args.step_sleep), "--startup-s", str(args.startup_s),
                    "--stamp")  # fmt: skip
        job = p.stdout.strip().splitlines()[-1]
        pending = list(zip(sched.times, sched.kinds(), strict=True))
        # Observing must not cost the job: each CLI call is a Python start-up, and polling
        # several times a second took most of a core from a 2-core node's ranks (and from
        # nothing in (a) or (b)). So: one `status` at each failure's time, then `wait`.
        st: dict[str, Any] = {}
        while pending:
            time.sleep(max(0.0, t0 + pending[0][0] - time.monotonic()))
            st = status_of(cli, job)
            if st.get("state") in TERMINAL:
                break
            if st.get("state") != "RUNNING":  # recovering, or the daemon is restarting
                time.sleep(1.0)
                continue
            _, kind = pending.pop(0)
            ranks_alive = [r for r in (rank_process(x["pid"]) for x in st["ranks"]) if r]
            if kind == "rank":
                kill(ranks_alive[-1:])
            else:  # the node's agent and its ranks
                daemon = int(json.loads((cli.home / "daemon.json").read_text())["pid"])
                kill([daemon, *ranks_alive])
        while st.get("state") not in TERMINAL:
            # (the daemon may be restarting: `wait` fails, and is asked again)
            cli.run("wait", job, "--timeout", "60", check=False, timeout=120)
            st = status_of(cli, job)
        took = time.monotonic() - t0
        assert st["state"] == "SUCCEEDED", st
        events = cli.json("events", job)["events"]
        windows = []
        for e in events:
            if e["kind"] == "snapshot" and e.get("took_s"):
                windows.append((e["time"] - e["took_s"] - 1, e["time"] + 1))
            if e["kind"] in ("failure", "recovered"):
                windows.append((e["time"] - 30, e["time"] + 5))
        logs = cli.home.glob("jobs/*/logs/rank-0.log")
        text = "".join(p.read_text(errors="replace") for p in logs)
        return {"time_s": took, "digest": json.loads(out.read_text())["digest"],
                "snapshots": sum(e["kind"] == "snapshot" for e in events),
                "recoveries": sum(e["kind"] == "recovered" for e in events),
                "policy": cli.json("policy", "show", job),
                "step_s": step_time(stamps(text), windows),
                "events": events}  # fmt: skip
    finally:
        cli.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--step-sleep", type=float, default=0.1)
    ap.add_argument("--startup-s", type=float, default=120.0,
                    help="the job's start-up cost (imports, data, model build) in seconds")
    ap.add_argument("--failures", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--b-kinds", type=lambda v: v.split(","), default=["save", "dcp-async"],
                    help="the job's own checkpoints for (b): save (torch.save by rank 0), "
                         "dcp-async (torch.distributed.checkpoint.async_save), or both")
    args = ap.parse_args()
    rows = []
    for i in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
            work = Path(tmp)
            a = run_a(args, work)
            # Failures strike while the job trains (one during its start-up costs every
            # method the same), evenly spaced: that spacing is the MTBF both methods are told.
            train_s = max(a["time_s"] - args.startup_s, 1.0)
            mtbf = train_s / (args.failures + 1)
            sched = Schedule([args.startup_s + mtbf * (j + 1) for j in range(args.failures)])
            bs: dict[str, dict[str, Any]] = {}
            for kind in args.b_kinds:
                cost = save_cost(kind, work)
                interval = math.sqrt(2 * cost * mtbf)
                k = max(1, round(interval / max(a["step_s"], 1e-3)))
                print(f"(a) {a['time_s']:.1f}s, {a['step_s'] * 1000:.1f} ms/step; failures at "
                      f"{[round(t) for t in sched.times]}s; {kind} stalls the step "
                      f"{cost * 1000:.1f} ms, K={k}", flush=True)  # fmt: skip
                b = run_b(args, work, sched, k, kind)
                b["save_cost_s"] = cost
                b["lost"] = 1 - a["time_s"] / b["time_s"]
                print(f"(b, {kind}) {b['time_s']:.1f}s, {b['relaunches']} relaunches, "
                      f"lost {b['lost']:.3f}", flush=True)  # fmt: skip
                bs[kind] = b
            c = run_c(args, work, sched, mtbf)
            for e in c["events"]:
                if e["kind"] in ("failure", "recovered"):
                    print(f"  (c) {describe(e)}", flush=True)
            # The ratio is taken against the checkpoint-restart that lost least: the one a
            # team would pick.
            best = min(bs.values(), key=lambda b: b["lost"])
            lost_b = best["lost"]
            lost_c = 1 - a["time_s"] / c["time_s"]
            row = {"round": i, "a": a, "b": bs, "c": c, "b_best": best["kind"],
                   "schedule_s": sched.times, "kinds": sched.kinds(),
                   "lost_b": lost_b, "lost_c": lost_c,
                   "ratio": lost_c / lost_b if lost_b > 0 else float("nan"),
                   "step_ratio": c["step_s"] / a["step_s"],
                   # (b) resumes from the job's own checkpoint, which holds the model and
                   # optimizer but not its place in the epoch (it replays the epoch from its
                   # first batch, as most training scripts do): it need not match (a).
                   "b_identical": {kd: a["digest"] == b["digest"] for kd, b in bs.items()},
                   "c_identical": a["digest"] == c["digest"]}  # fmt: skip
            rows.append(row)
            lost_bs = ", ".join(f"{kd} {b['time_s']:.1f}s K={b['k']} lost {b['lost']:.3f}"
                                for kd, b in bs.items())  # fmt: skip
            print(f"round {i}: (a) {a['time_s']:.1f}s  (b) {lost_bs}  (c) {c['time_s']:.1f}s "
                  f"lost {lost_c:.3f} ({c['snapshots']} snapshots, {c['recoveries']} "
                  f"recoveries)  ratio (c)/(b, {best['kind']}) {row['ratio']:.2f}  step time "
                  f"(c)/(a) {row['step_ratio']:.3f}  final parameters as (a): (b) "
                  f"{row['b_identical']}, (c) {row['c_identical']}", flush=True)  # fmt: skip
    med = {k: statistics.median(r[k] for r in rows) for k in ("lost_b", "lost_c", "ratio",
                                                              "step_ratio")}  # fmt: skip
    print(f"median over {len(rows)} round(s): lost throughput checkpoint-restart "
          f"{med['lost_b']:.3f}, snapshotter {med['lost_c']:.3f}, ratio {med['ratio']:.2f} "
          f"(target <= 0.15); step time with a policy / torchrun {med['step_ratio']:.3f} "
          "(target <= 1.01)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "median": med}, indent=2,
                                              default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
