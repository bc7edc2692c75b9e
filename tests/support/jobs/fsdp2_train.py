"""A job on FSDP2 as its users write it: `fully_shard` on every layer and on the root, AdamW,
a seeded per-rank batch stream, a logging allreduce every step; CPU and gloo under torchrun,
nothing of snapshotter. Every step all-gathers each layer's parameters and reduce-scatters
its gradients (functional collectives, issued from C++).

usage: fsdp2_train.py --out OUT [--steps N] [--step-sleep S]
Prints "rank R step N loss L" per step; rank 0 writes the sha256 of the full final
parameters (gathered from their shards) to OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(1, a.steps + 1):
        x = torch.randn(32, 16, generator=data)
        y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        print(f"rank {rank} step {step} loss {mean.item() / dist.get_world_size():.6f}",
              flush=True)  # fmt: skip
        time.sleep(a.step_sleep)
    h = hashlib.sha256()
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective: every rank
        h.update(full.detach().contiguous().numpy().tobytes())
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"digest": h.hexdigest()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
