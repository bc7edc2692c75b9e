"""Benchmark: what the hook adds to each collective, measured in one process so that the
machine's noise between runs cancels out.

One rank (world size 1, gloo over a HashStore: each allreduce is pure overhead, no network) holds
five process groups made the ways a rank can: plain torch (`dist.new_group` before the hook is
installed), the hook's native path (csrc/gate.cpp) and its Python fallback, each of those two
with and without its telemetry (the latency record `snapshotter top` reads;
SNAPSHOTTER_TELEMETRY=0 turns it off). Each drives the same
DDP model with tiny gradient buckets (24 allreduces a step, every one issued from C++ by DDP's
Reducer, the path that paid the most), and a loop of Python-issued `dist.all_reduce`. Rounds
alternate the order; the table gives medians over the rounds: step time, the ratio to plain, and
microseconds added per collective.

Usage: python bench/hook_overhead.py [--rounds 15] [--steps 200] [--json out.json]
Needs torch and the native path built (python -m snapshotter.hook.native --build).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from snapshotter.hook import native, resumable  # noqa: E402
from snapshotter.hook.barrier import QuiesceBarrier  # noqa: E402
from snapshotter.hook.sockets import Owned  # noqa: E402

LAYERS = 12  # 24 parameters: 24 buckets of one parameter each


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _groups() -> dict[str, Any]:
    """Three single-rank groups: plain, native, python (the hook installed in between)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                      RANK="0", WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("gloo")
    plain = dist.new_group([0])
    ext = native.load()
    if ext is None:
        raise SystemExit("the native path is not built: python -m snapshotter.hook.native --build")

    def parked(*_: object) -> None:
        pass

    out: dict[str, Any] = {"plain": plain}
    for name in ("native", "native-notel", "python", "python-notel"):
        # Both the gate and the registry read the switch when they are made.
        os.environ["SNAPSHOTTER_TELEMETRY"] = "0" if name.endswith("notel") else "1"
        barrier = (native.NativeBarrier(ext, parked) if name.startswith("native")
                   else QuiesceBarrier(parked))  # fmt: skip
        registry = resumable.GroupRegistry(barrier, Owned())
        resumable.c10d._snapshotter_installed = False  # type: ignore[attr-defined]
        resumable.install(registry)
        out[name] = dist.new_group([0])
    os.environ.pop("SNAPSHOTTER_TELEMETRY")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(1)
    groups = _groups()
    x = torch.randn(2, 4)
    t = torch.zeros(1)

    def ddp(pg: Any) -> Any:
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(LAYERS)])
        return torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=1e-5, process_group=pg)

    models = {k: ddp(pg) for k, pg in groups.items()}

    def ddp_us(k: str) -> float:
        m = models[k]
        t0 = time.perf_counter()
        for _ in range(a.steps):
            m(x).sum().backward()
        return (time.perf_counter() - t0) / a.steps * 1e6

    def py_us(k: str) -> float:
        t0 = time.perf_counter()
        for _ in range(a.steps * 10):
            dist.all_reduce(t, group=groups[k])
        return (time.perf_counter() - t0) / (a.steps * 10) * 1e6

    arms = list(groups)
    for k in arms:  # warm up
        ddp_us(k)
        py_us(k)
    runs: dict[str, dict[str, list[float]]] = {w: {k: [] for k in arms} for w in ("ddp", "py")}
    for i in range(a.rounds):
        order = arms[i % len(arms):] + arms[: i % len(arms)]
        for k in order:
            runs["ddp"][k].append(ddp_us(k))
            runs["py"][k].append(py_us(k))
    report: dict[str, Any] = {}
    per_op = {"ddp": 2 * LAYERS, "py": 1}
    print(f"{'workload':<28} {'path':<13} {'us/step':>9} {'ratio':>7} {'+us/collective':>15}")
    for w, label in (("ddp", "DDP step, 24 C++ allreduces"), ("py", "dist.all_reduce (Python)")):
        base = runs[w]["plain"]
        for k in arms:
            ratios = [h / p for p, h in zip(base, runs[w][k], strict=True)]
            added = [(h - p) / per_op[w] for p, h in zip(base, runs[w][k], strict=True)]
            r = {"us": round(statistics.median(runs[w][k]), 1),
                 "ratio": round(statistics.median(ratios), 3),
                 "added_us_per_collective": round(statistics.median(added), 2)}  # fmt: skip
            report[f"{w}/{k}"] = r
            print(f"{label:<28} {k:<13} {r['us']:>9.1f} {r['ratio']:>7.3f} "
                  f"{r['added_us_per_collective']:>15.2f}")  # fmt: skip
    # What the telemetry alone costs: the same path with and without it, side by side.
    for w in ("ddp", "py"):
        for k in ("native", "python"):
            on, off = runs[w][k], runs[w][f"{k}-notel"]
            added = statistics.median((x - y) / per_op[w] for x, y in zip(on, off, strict=True))
            report[f"{w}/{k}/telemetry_us_per_collective"] = round(added, 2)
            print(f"telemetry on the {k} path ({w}): {added:+.2f} us a collective")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
