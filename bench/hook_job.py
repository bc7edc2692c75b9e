"""The hook benchmark's job: a DDP (with a chosen gradient bucket size) or FSDP2 model
trained for --steps; prints one `RESULT {...}` line with the median step time over the steps
after --warmup and the collectives issued per step. Knows nothing of snapshotter.

usage: hook_job.py --mode ddp|fsdp2 [--bucket-mb MB] [--steps N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    layers: list[nn.Module] = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.ReLU()]
    model: nn.Module = nn.Sequential(*layers).to(dev)
    if a.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, a.width, generator=torch.Generator().manual_seed(rank)).to(dev)
    times: list[float] = []
    for step in range(a.steps + a.warmup):
        t0 = time.perf_counter()
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
    # Collectives per step, from the process group's own sequence number (both runs alike).
    seq = -1
    try:
        # The backend's own (the group's answers only for torch's named backend types, and a
        # group on the hook's native path is "custom").
        group: Any = dist.distributed_c10d._get_default_group()
        seq = int(group._get_backend(dev)._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - reporting only
        pass
    per_step = round(seq / (a.steps + a.warmup), 1) if seq > 0 else None
    if rank == 0:
        print("RESULT " + json.dumps({"median_step_ms": round(statistics.median(times) * 1e3, 3),
                                      "collectives_per_step": per_step}), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
