"""The device check's training job: deterministic, prints `step N` per step and one
`RESULT {...}` line (sha256 of the final parameters) at the end. CUDA when --device cuda;
with WORLD_SIZE > 1 (or --dist) it is DDP over --backend (NCCL on CUDA, gloo on CPU).
Knows nothing of snapshotter."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    ap.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                    help="auto: nccl on CUDA, gloo on CPU")
    ap.add_argument("--dist", action="store_true", help="use a process group even when alone")
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(a.layers):
        layers += [torch.nn.Linear(a.width, a.width), torch.nn.GELU()]
    model: torch.nn.Module = torch.nn.Sequential(*layers).to(dev)
    distributed = world > 1 or a.dist
    if distributed:
        backend = a.backend if a.backend != "auto" else (
            "nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type != "cuda":
            backend = "gloo"  # the CPU rehearsal of an NCCL case
        dist.init_process_group(backend)
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[0] if dev.type == "cuda" else None
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = torch.zeros(())
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, a.width, generator=g).to(dev)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"step {step}", flush=True)
        time.sleep(a.step_sleep)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    print("RESULT " + json.dumps({"rank": rank, "digest": h.hexdigest(),
                                  "loss": float(loss)}), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
