"""A training loop on Hugging Face Accelerate, as its users write it: `Accelerator`,
`prepare`, `accelerator.backward`, a seeded DataLoader; CPU and gloo under torchrun, nothing
of snapshotter.

usage: accelerate_loop.py --out OUT [--steps N] [--step-sleep S]
Prints "rank R step N loss L" per step; rank 0 writes the sha256 of the final parameters to
OUT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-sleep", type=float, default=0.02)
    a = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(99))  # fmt: skip
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    lossf = nn.BCEWithLogitsLoss()
    rank = accelerator.process_index
    step = 0
    while step < a.steps:
        for xb, yb in loader:
            opt.zero_grad()
            loss = lossf(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            step += 1
            mean = accelerator.reduce(loss.detach(), reduction="mean")  # a logging collective
            print(f"rank {rank} step {step} loss {mean.item():.6f}", flush=True)
            time.sleep(a.step_sleep)
            if step >= a.steps:
                break
    h = hashlib.sha256()
    for p in accelerator.unwrap_model(model).parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    if accelerator.is_main_process:
        with open(a.out, "w") as f:
            json.dump({"digest": h.hexdigest()}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
