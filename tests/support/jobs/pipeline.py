"""A 2-stage pipeline-parallel job: stage 0 (rank 0) sends each micro-batch's activations to
stage 1 with `isend`, stage 1 sends the gradients back, every step, on gloo; nothing of
snapshotter. Rank 0 also sends a control message each step: it ends the run at the next
multiple of 50 steps once STOP_FILE exists (so a test can run it as long as it needs) or at
--steps.

usage: pipeline.py --out OUT [--steps N] [--stop-file F] [--step-sleep S]
Prints "rank R step N loss L"; each rank writes the sha256 of its stage's final parameters
and the steps run to OUT.<rank>.
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

MICRO = 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    stage0 = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1))
    stage1 = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))
    model = stage0 if rank == 0 else stage1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    lossf = nn.BCEWithLogitsLoss()
    torch.manual_seed(100 + rank)
    step = 0
    while True:
        step += 1
        g = torch.Generator().manual_seed(step)
        x = torch.randn(MICRO, 16, 16, generator=g)
        y = (x[:, :, :4].sum(dim=2, keepdim=True) > 0).float()
        ctrl = torch.zeros(1)
        opt.zero_grad()
        if rank == 0:
            stop = step >= a.steps or (
                step % 50 == 0 and bool(a.stop_file) and os.path.exists(a.stop_file)
            )
            ctrl[0] = float(stop)
            reqs = [dist.isend(ctrl, 1)]
            acts = [model(x[m]) for m in range(MICRO)]
            reqs += [dist.isend(act.detach().contiguous(), 1) for act in acts]
            grads = [torch.empty(16, 64) for _ in range(MICRO)]
            reqs += [dist.irecv(gr, 1) for gr in grads]
            for r in reqs:
                r.wait()
            for act, gr in zip(acts, grads, strict=True):
                act.backward(gr)
            loss = 0.0
        else:
            acts = [torch.empty(16, 64) for _ in range(MICRO)]
            reqs = [dist.irecv(ctrl, 0)] + [dist.irecv(act, 0) for act in acts]
            for r in reqs:
                r.wait()
            stop = bool(ctrl[0].item())
            sends, loss = [], 0.0
            for m, act in enumerate(acts):
                act.requires_grad_(True)
                out = lossf(model(act), y[m])
                out.backward()
                loss += out.item() / MICRO
                assert act.grad is not None
                sends.append(dist.isend(act.grad.contiguous(), 0))
            for r in sends:
                r.wait()
        opt.step()
        print(f"rank {rank} step {step} loss {loss:.6f}", flush=True)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if stop:
            break

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    with open(f"{a.out}.{rank}", "w") as f:
        json.dump({"digest": h.hexdigest(), "steps": step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
