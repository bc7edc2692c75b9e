"""A 2-rank gloo DDP job that knows nothing of snapshotter.

usage: ddp_train.py OUT_PATH [STEPS]
Prints "step N loss L" per step; writes the sha256 of the final parameters to OUT_PATH (rank 0).
"""

import hashlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    out_path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(2048, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, shuffle=True, seed=7)
    loader = DataLoader(
        ds,
        batch_size=16,
        sampler=sampler,
        num_workers=2,
        generator=torch.Generator().manual_seed(99),
    )
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    lossf = nn.BCEWithLogitsLoss()
    torch.manual_seed(100 + rank)  # dropout masks differ per rank, deterministically

    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            loss = lossf(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step >= steps:
                break
        epoch += 1

    h = hashlib.sha256()
    for p in ddp.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    if rank == 0:
        with open(out_path, "w") as f:
            f.write(h.hexdigest())
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
