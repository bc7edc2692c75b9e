"""A small CPU DDP training job that knows nothing of snapshotter.

Run it with torchrun or `snapshotter run`: gloo process group, a DataLoader with worker
processes, dropout, AdamW. At the end rank 0 writes the sha256 of the final parameters (and the
last loss) to --out, which is how runs are compared bit for bit.

Options for benchmarks and tests: --step-sleep slows every step (a stand-in for a bigger model),
--pause-at/--pause-s makes a long phase without collectives, --ckpt/--ckpt-every/--resume are
the application checkpoint a cold restart would use (--ckpt-kind: torch.save by rank 0, or
torch.distributed.checkpoint.async_save by every rank), --crash-at N makes --crash-rank fail with
a Python exception at step N (a bug that comes back after every restore), --startup-s stands
for a real job's start-up (imports, data preparation, model build), --stamp adds the wall time
to every step line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
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


class DcpCheckpoints:
    """torch.distributed.checkpoint.async_save every K steps, one directory per save; the
    `latest` file names the newest complete one (written once its save finished, so a
    save cut short by a failure is never resumed from). The step waits only for the
    previous save to finish, as torch asks, and for the copy into host memory."""

    def __init__(self, root: str, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.root, self.model, self.opt = root, model, opt
        self.pending = None  # (future, step, epoch, directory)
        # The save's own group: its collectives run in a background thread, and two threads
        # interleaving collectives on one gloo group deadlock (DDP's on the training thread).
        self.group = dist.new_group(backend="gloo")
        os.makedirs(root, exist_ok=True)

    def save(self, step: int, epoch: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.finish()
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        path = os.path.join(self.root, f"step-{step}")
        fut = dcp.async_save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path,
                             process_group=self.group)  # fmt: skip
        self.pending = (fut, step, epoch, path)

    def finish(self) -> None:
        if self.pending is None:
            return
        fut, step, epoch, path = self.pending
        self.pending = None
        fut.result()
        if dist.get_rank() == 0:
            tmp = os.path.join(self.root, "latest.tmp")
            with open(tmp, "w") as f:
                json.dump({"path": path, "step": step, "epoch": epoch}, f)
            os.replace(tmp, os.path.join(self.root, "latest"))
            for old in os.listdir(self.root):  # what `latest` no longer names
                if old.startswith("step-") and os.path.join(self.root, old) != path:
                    shutil.rmtree(os.path.join(self.root, old), ignore_errors=True)

    def load(self) -> tuple[int, int]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        latest = os.path.join(self.root, "latest")
        if not os.path.exists(latest):
            return 0, 0
        with open(latest) as f:
            at = json.load(f)
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=at["path"], process_group=self.group)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
        return int(at["step"]), int(at["epoch"])


@record  # an uncaught exception is written to TORCHELASTIC_ERROR_FILE, as under torchrun
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
    ap.add_argument("--ckpt-kind", choices=("save", "dcp-async"), default="save",
                    help="torch.save by rank 0, or torch.distributed.checkpoint.async_save "
                         "by every rank into --ckpt as a directory")  # fmt: skip
    ap.add_argument("--startup-s", type=float, default=0.0)
    ap.add_argument("--startup-rank", type=int, default=-1,
                    help="only this rank waits --startup-s before joining (default: every rank)")
    ap.add_argument("--stamp", action="store_true")
    ap.add_argument("--crash-at", type=int, default=-1)
    ap.add_argument("--crash-rank", type=int, default=0)
    a = ap.parse_args()

    me = int(os.environ.get("RANK", "0"))
    if a.startup_s and a.startup_rank in (-1, me):
        time.sleep(a.startup_s)
    print(f"rank {me} joins the process group", flush=True)
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
    dcp_ckpt = DcpCheckpoints(a.ckpt, model, opt) if a.ckpt and a.ckpt_kind == "dcp-async" else None
    if a.resume and a.ckpt and os.path.exists(a.ckpt):
        t0 = time.monotonic()
        if dcp_ckpt is not None:
            step, epoch = dcp_ckpt.load()
        else:
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
            if dcp_ckpt is not None and a.ckpt_every and step % a.ckpt_every == 0:
                dcp_ckpt.save(step, epoch)
            elif a.ckpt and a.ckpt_every and step % a.ckpt_every == 0 and rank == 0:
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

    if dcp_ckpt is not None:
        dcp_ckpt.finish()
    digest = param_digest(model)
    print(f"rank {rank} done steps {step} digest {digest}", flush=True)
    if rank == 0 and a.out:
        with open(a.out, "w") as f:
            json.dump({"digest": digest, "loss": loss.item(), "steps": step}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
