"""A small CPU DDP training job that knows nothing of snapshotter.

Run it with torchrun or `snapshotter run`: gloo process group, a DataLoader with worker
processes, dropout, AdamW. At the end rank 0 writes the sha256 of the final parameters (and the
last loss) to --out, which is how runs are compared bit for bit.

Options for benchmarks and tests: --step-sleep slows every step (a stand-in for a bigger model),
--pause-at/--pause-s makes a long phase without collectives, --ckpt/--ckpt-every/--resume are
the application checkpoint a cold restart would use, --crash-at N makes --crash-rank fail with
a Python exception at step N (a bug that comes back after every restore), --startup-s stands
for a real job's start-up (imports, data preparation, model build), --stamp adds the wall time
to every step line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(n: int = 4096, dim: int = 32, classes: int = 10) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, classes, generator=g)
    y = (x @ w + 0.1 * torch.randn(n, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model(dim: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.Linear(256, classes),
    )


def param_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--persistent-workers", action="store_true")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--pause-s", type=float, default=0.0)
    ap.add_argument("--out", default="")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--startup-s", type=float, default=0.0)
    ap.add_argument("--stamp", action="store_true")
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=0)
    a = ap.parse_args()

    if a.startup_s:
        time.sleep(a.startup_s)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42 + rank)  # dropout differs per rank, deterministically

    data = make_data()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7)
    loader = DataLoader(
        data,
        batch_size=a.batch,
        sampler=sampler,
        num_workers=a.workers,
        persistent_workers=a.persistent_workers and a.workers > 0,
        generator=torch.Generator().manual_seed(99),
    )
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(42 + rank)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, weight_decay=0.01)
    loss_fn = nn.CrossEntropyLoss()

    step, epoch = 0, 0
    if a.resume and a.ckpt and os.path.exists(a.ckpt):
        t0 = time.monotonic()
        st = torch.load(a.ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, epoch = st["step"], st["epoch"]
        print(
            f"rank {rank} resumed from {a.ckpt} at step {step} in {time.monotonic() - t0:.3f}s",
            flush=True,
        )

    loss = torch.tensor(0.0)
    t_first = None
    while step < a.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= a.steps:
                break
            if step == a.crash_at and rank == a.crash_rank:
                raise RuntimeError(f"injected bug at step {step} on rank {rank}")
            if step == a.pause_at:
                time.sleep(a.pause_s)  # a long phase with no collective
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            opt.step()
            step += 1
            if t_first is None:
                t_first = time.time()
                print(f"rank {rank} first step at {t_first:.6f}", flush=True)
            stamp = f" t={time.time():.6f}" if a.stamp else ""
            print(f"rank {rank} step {step} loss {loss.item():.6f}{stamp}", flush=True)
            if a.step_sleep:
                time.sleep(a.step_sleep)
            if a.ckpt and a.ckpt_every and step % a.ckpt_every == 0 and rank == 0:
                tmp = a.ckpt + ".tmp"
                torch.save(
                    {
                        "model": model.state_dict(),
                        "opt": opt.state_dict(),
                        "step": step,
                        "epoch": epoch,
                    },
                    tmp,
                )
                os.replace(tmp, a.ckpt)
        epoch += 1

    digest = param_digest(model)
    print(f"rank {rank} done steps {step} digest {digest}", flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"digest": digest, "loss": loss.item(), "steps": step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
