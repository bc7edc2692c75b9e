"""Device check for application checkpoints (issue 16): CUDA state saved with dcp.async_save
through snapshotter.checkpoint.writer and loaded back with its reader, bit-identical.

    python bench/gpu_ckpt_check.py --device cuda --mib 1024     # on the GPU machine
    python bench/gpu_ckpt_check.py --device cpu --mib 64        # the CPU rehearsal

Prints one JSON line: whether the staging slots were pinned (cudaHostRegister), the stall of
each save (device-to-host copy into the slot), its GB/s, the time until the save was durable,
and whether the loaded tensors equal the saved ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from snapshotter.checkpoint import reader, writer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--saves", type=int, default=3)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    base = tempfile.mkdtemp(prefix="gpu-ckpt-check-")
    url = f"file://{base}/store"
    n = a.mib * 1024 * 1024 // 4 // 8
    g = torch.Generator(device=a.device).manual_seed(0)
    state = {f"w{i}": torch.randn(n, device=a.device, generator=g) for i in range(8)}
    w = writer(url)
    stalls, durable = [], []
    for i in range(a.saves):
        for t in state.values():
            t.add_(1.0)
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=w, checkpoint_id=f"s{i}")
        stalls.append(time.perf_counter() - t0)
        fut.result()
        durable.append(time.perf_counter() - t0)
    pinned = [s._pinned for s in w._stager._slots]
    w.close()
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=reader(url))
    equal = all(torch.equal(loaded[k], state[k]) for k in state)
    stall = statistics.median(stalls)
    print(json.dumps({
        "case": "app-checkpoint", "device": a.device, "mib": a.mib, "pinned": pinned,
        "stall_s": [round(s, 4) for s in stalls], "stall_gbps": round(a.mib / 1024 / stall, 2),
        "durable_s": [round(d, 3) for d in durable], "equal": equal,
    }), flush=True)  # fmt: skip
    shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if equal and (a.device != "cuda" or all(pinned)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
