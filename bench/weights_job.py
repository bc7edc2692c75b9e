"""The processes of bench/weights_bench.py: one publisher and N replicas moving a state of
--mib MiB, --reps times, by one of three means:

  push       snapshotter.weights (run under node agents: publish / subscribe + update)
  saveload   what a user writes without it: torch.save to shared storage, torch.load
  broadcast  torch.distributed.broadcast over gloo (run under torchrun, rank 0 publishes)

Each rep changes every tensor, stamps the wall clock when the publisher starts (t0) and when
each replica holds the new weights in its own tensors (t1); files in --dir carry the stamps
(one host, one clock). The publisher waits for every replica before the next rep, so no
version is skipped. --out FILE (publisher): {"t0": [...], "stall": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

TENSORS = 8


DEVICE = "cpu"


def state(mib: int, fill: float) -> dict[str, torch.Tensor]:
    n = mib * (1 << 20) // 4 // TENSORS
    return {f"layer{i}.weight": torch.full((n,), fill + i, device=DEVICE) for i in range(TENSORS)}


def wait_for(path: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.005)


def stamp(path: Path, t: float) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(repr(t))
    os.replace(tmp, path)


def wait_replicas(d: Path, rep: int, replicas: int) -> None:
    deadline = time.monotonic() + 300
    while len(list(d.glob(f"got-{rep}-*"))) < replicas:
        if time.monotonic() > deadline:
            raise SystemExit(f"replicas did not all take rep {rep}")
        time.sleep(0.005)


def publisher(a: argparse.Namespace) -> dict[str, list[float]]:
    from snapshotter import weights

    d = Path(a.dir)
    s = state(a.mib, 0.0)
    out: dict[str, list[float]] = {"t0": [], "stall": []}
    for rep in range(1, a.reps + 1):
        for t in s.values():
            t.add_(1.0)
        t0 = time.time()
        if a.how == "push":
            weights.publish(s, version=rep, channel="bench")
        else:
            tmp = d / f".w-{rep}.pt"
            torch.save(s, tmp)
            os.replace(tmp, d / f"w-{rep}.pt")
        out["stall"].append(time.time() - t0)
        out["t0"].append(t0)
        wait_replicas(d, rep, a.replicas)
        (d / f"w-{rep}.pt").unlink(missing_ok=True)
    return out


def replica(a: argparse.Namespace) -> None:
    d = Path(a.dir)
    s = state(a.mib, -1.0)
    sub = None
    if a.how == "push":
        from snapshotter import weights

        sub = weights.subscribe("bench")
    for rep in range(1, a.reps + 1):
        if sub is not None:
            while sub.update(s) != rep:
                time.sleep(0.005)
        else:
            wait_for(d / f"w-{rep}.pt")
            got = torch.load(d / f"w-{rep}.pt")
            for k, t in s.items():
                t.copy_(got[k])
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        t1 = time.time()
        for i, t in enumerate(s.values()):
            assert bool((t == rep + i).all()), f"replica holds the wrong bytes in rep {rep}"
        stamp(d / f"got-{rep}-{a.name}", t1)


def broadcast(a: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = state(a.mib, 0.0 if rank == 0 else -1.0)
    t0s, stalls = [], []
    for rep in range(1, a.reps + 1):
        dist.barrier()
        if rank == 0:
            for t in s.values():
                t.add_(1.0)
        t0 = time.time()
        for t in s.values():
            dist.broadcast(t, src=0)
        t1 = time.time()
        assert float(s["layer0.weight"][0]) == rep
        if rank == 0:
            t0s.append(t0)
            stalls.append(t1 - t0)  # the sender takes part in the whole broadcast
        else:
            stamp(Path(a.dir) / f"got-{rep}-{rank}", t1)
    dist.barrier()
    if rank == 0 and a.out:
        Path(a.out).write_text(json.dumps({"t0": t0s, "stall": stalls}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["publisher", "replica", "broadcast"], required=True)
    p.add_argument("--how", choices=["push", "saveload"], default="push")
    p.add_argument("--dir", required=True)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--name", default="r")
    p.add_argument("--device", default="cpu", help="where the tensors live (cuda: GPU 0)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    torch.set_num_threads(1)
    if a.role == "broadcast":
        broadcast(a)
    elif a.role == "replica":
        replica(a)
        if a.out:
            Path(a.out).write_text("{}")
    else:
        out = publisher(a)
        if a.out:
            Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
