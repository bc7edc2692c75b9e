"""A DDP job (gloo) with a chosen amount of state per rank, for the storage benchmark.

    torchrun --nproc-per-node 2 bench/state_job.py --frozen-mb 512 --trainable-mb 64

`--frozen-mb` of weights that do not train (a fine-tuned backbone: LoRA and adapter jobs hold
mostly such state) and `--trainable-mb` of weights trained with Adam (whose state is the
weights, their gradients and two moments: 4x what they take, all of it changed every step).
Every rank holds the same values (data-parallel replicas). Prints "rank R step N loss L".

--save-dcp DIR: after step --save-at, save model and optimizer with torch.distributed.checkpoint
and exit. --load-dcp DIR: load them before the first step (the checkpoint-restart baseline
measures launch to the first step printed after such a load).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH = 1024  # a layer is WIDTH x WIDTH float32: 4 MiB


def layers(mb: int) -> int:
    return max(1, mb // 4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frozen-mb", type=int, default=256)
    ap.add_argument("--trainable-mb", type=int, default=32)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--step-sleep", type=float, default=0.2)
    ap.add_argument("--save-dcp", default="")
    ap.add_argument("--save-at", type=int, default=3)
    ap.add_argument("--load-dcp", default="")
    ap.add_argument("--out", default="")  # what harnesses pass every job; unused
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    backbone = nn.Sequential(
        *[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers(a.frozen_mb))]
    )
    for p in backbone.parameters():
        p.requires_grad_(False)
    head = nn.Sequential(
        *[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers(a.trainable_mb))]
    )
    model = DDP(head)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if a.load_dcp:
        state = {"backbone": backbone.state_dict(), "model": head.state_dict(),
                 "optim": opt.state_dict()}  # fmt: skip
        dcp.load(state, checkpoint_id=a.load_dcp)
        backbone.load_state_dict(state["backbone"])
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    g = torch.Generator().manual_seed(100 + rank)
    x0 = torch.randn(8, WIDTH, generator=g)
    with torch.no_grad():
        feats = backbone[:2](x0)  # touch a little of the backbone each step, as inference does
    for step in range(1, a.steps + 1):
        opt.zero_grad()
        loss = model(feats).pow(2).mean()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f} t {time.time():.3f}", flush=True)
        if a.save_dcp and step == a.save_at:
            state = {"backbone": backbone.state_dict(), "model": head.state_dict(),
                     "optim": opt.state_dict()}  # fmt: skip
            dcp.save(state, checkpoint_id=a.save_dcp)
            break
        time.sleep(a.step_sleep)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
