"""A job that is almost always inside a collective: every step all-reduces a large tensor
whose exact sum is known (small integers in float32 add up exactly, in any order), so a link
that dies during a step dies mid-collective, and any lost, doubled or wrong contribution
shows in the result. CPU and gloo under torchrun (or snapshotter run); nothing of snapshotter.

usage: allreduce_loop.py --out OUT [--steps N] [--numel N] [--step-sleep S]
Prints "rank R step N" per step; rank 0 writes {"steps", "ok", "bad_steps"} to OUT, where
`ok` says every step's reduced tensor was exactly the expected one.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def contribution(step: int, rank: int, numel: int) -> torch.Tensor:
    return ((torch.arange(numel) + step * 7 + rank * 3) % 13).to(torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--numel", type=int, default=4_000_000)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for step in range(1, a.steps + 1):
        t = contribution(step, rank, a.numel)
        dist.all_reduce(t)
        want = sum(contribution(step, r, a.numel) for r in range(world))
        if not torch.equal(t, want):
            bad.append(step)
        print(f"rank {rank} step {step} done", flush=True)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    dist.barrier()
    if rank == 0:
        tmp = f"{a.out}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"steps": a.steps, "ok": not bad, "bad_steps": bad[:20]}, f)
        os.replace(tmp, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
