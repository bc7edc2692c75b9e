"""Data-parallel training that checkpoints with torch.distributed.checkpoint through snapshotter.

    snapshotter run --nproc-per-node 2 examples/train_dcp_async.py --steps 40 --save-every 5
    snapshotter run --nproc-per-node 2 examples/train_dcp_async.py --steps 40 --resume

Every `--save-every` steps it calls `dcp.async_save` with `snapshotter.checkpoint.writer`: the
training loop pays only the copy of its state into memory (printed as `stall`), the node agent
uploads while training goes on. `--resume` loads the newest checkpoint with
`snapshotter.checkpoint.reader` and trains on from its step; the losses then match an
uninterrupted run. `--out FILE` writes the losses, stalls and a digest of the weights as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from snapshotter.checkpoint import reader, writer


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 256, generator=g)
    return x, x[:, :8].sum(dim=1, keepdim=True)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--store", default=None,
                   help="store URL (default: SNAPSHOTTER_STORE, else the node agent's)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--name", default="step", help="checkpoints are named NAME-<step>")
    p.add_argument("--width", type=int, default=1024, help="hidden width (state size)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Checkpoint collectives on a group of their own: async_save plans on a background thread.
    ckpt_group = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(256, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, 1)
    )
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    if a.resume:
        # get_state_dict gives the optimizer's full state (a fresh Adam has none to load into).
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, storage_reader=reader(a.store), process_group=ckpt_group)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
    w = writer(a.store)
    losses, stalls, pending = [], [], None
    for step in range(start, a.steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 8))
        print(f"rank {rank} step {step + 1} loss {loss.item():.6f}", flush=True)
        if (step + 1) % a.save_every == 0:
            if pending is not None:
                pending.result()  # at most one upload behind: the writer's second slot
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            pending = dcp.async_save(
                {"model": msd, "optim": osd, "step": step + 1},
                storage_writer=w,
                checkpoint_id=f"{a.name}-{step + 1:06d}",
                process_group=ckpt_group,
            )
            stalls.append(time.perf_counter() - t0)
        if a.step_sleep:
            time.sleep(a.step_sleep)
    if pending is not None:
        pending.result()
    w.close()
    out = {"rank": rank, "start": start, "losses": losses, "stalls": stalls, "digest": digest(net),
           "via_agent": bool(os.environ.get("SNAPSHOTTER_CKPT_SPOOL"))}
    print(json.dumps({k: out[k] for k in ("rank", "start", "digest", "via_agent")}), flush=True)
    if a.out and rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
