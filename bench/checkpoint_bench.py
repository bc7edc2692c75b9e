"""Application checkpoints: what a save costs the training loop, side by side in one run.

    python bench/checkpoint_bench.py --mib 512 --rounds 5

Per round, in rotating order, the same state dict (`--mib` of float32 tensors, `--tensors` of
them) is saved three ways:

    torch.save         to a file in --dir: the loop waits for all of it
    dcp.async_save     with torch's FileSystemWriter to --dir (its default stager)
    snapshotter        dcp.async_save with snapshotter.checkpoint.writer to file://--dir/store

For each it reports the rank's stall (until the call returns) and the time until the save is
durable (the future done), as medians; the ratios of snapshotter's stall to the other two; and
the shortest checkpoint interval each sustains at <= 1% step-time overhead: the stall must be
<= 1% of the interval and the upload must finish within it (max(100 x stall, upload)). Then a
second snapshotter save with `--change` of the tensors modified shows what dedup against the
previous checkpoint leaves to upload. Run it standalone (the upload runs in a child process of
the rank, the same code the node agent runs) or under `snapshotter run` (the agent uploads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from snapshotter.checkpoint import catalog, spool, writer


def _state(mib: int, tensors: int) -> dict[str, torch.Tensor]:
    n = mib * 1024 * 1024 // 4 // tensors
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=512, help="state size in MiB")
    p.add_argument("--tensors", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--change", type=float, default=0.1, help="share of tensors changed for dedup")
    p.add_argument("--dir", default=None, help="where saves go (default: a temp dir)")
    p.add_argument("--agent", action="store_true",
                   help="under `snapshotter run`: save to the node agent's store, so the agent "
                   "uploads (default: a store in --dir, uploaded by the rank's child process)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)  # fmt: skip
    base = Path(a.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    url = f"file://{base / 'store'}"
    if a.agent:
        url = os.environ.get(spool.STORE_ENV, "")
        if not url.startswith(("file://", "/")):
            raise SystemExit("--agent: run under `snapshotter run` with a file:// agent store")
    run_id = os.urandom(3).hex()  # checkpoint names unique in a store shared across runs
    state = _state(a.mib, a.tensors)
    snap_writer = writer(url)
    times: dict[str, dict[str, list[float]]] = {
        m: {"stall": [], "durable": []} for m in ("torch.save", "dcp.async_save", "snapshotter")
    }

    def run(method: str, r: int) -> None:
        target = base / f"{method}-{r}"
        t0 = time.perf_counter()
        if method == "torch.save":
            torch.save(state, target)
            stall = durable = time.perf_counter() - t0
        else:
            w = snap_writer if method == "snapshotter" else dcp.FileSystemWriter(str(target))
            fut = dcp.async_save(state, storage_writer=w, checkpoint_id=f"b{run_id}-{r}" if
                                 method == "snapshotter" else str(target))  # fmt: skip
            stall = time.perf_counter() - t0
            fut.result()
            durable = time.perf_counter() - t0
        times[method]["stall"].append(stall)
        times[method]["durable"].append(durable)
        if target.exists():
            shutil.rmtree(target) if target.is_dir() else target.unlink()

    methods = list(times)
    for r in range(a.rounds):
        for m in methods[r % 3:] + methods[: r % 3]:
            run(m, r)

    # Dedup: the state again with a share of its tensors changed.
    store_dir = Path(url.removeprefix("file://")) / "checkpoints"
    before = _du(store_dir)
    keys = list(state)
    for k in keys[: max(1, int(len(keys) * a.change))]:
        state[k].add_(1.0)
    t0 = time.perf_counter()
    dcp.async_save(state, storage_writer=snap_writer, checkpoint_id=f"b{run_id}-changed").result()
    changed_s = time.perf_counter() - t0
    added = _du(store_dir) - before
    snap_writer.close()
    listed = [c.name for c in catalog.list_checkpoints(catalog.checkpoint_store(url))]

    med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    size = a.mib * 1024 * 1024
    out: dict[str, Any] = {
        "state_mib": a.mib, "tensors": a.tensors, "rounds": a.rounds,
        "via_agent": spool.agent_spool(os.environ, url) is not None,
        "median_s": med,
        "stall_ratio_vs_torch_save": med["snapshotter"]["stall"] / med["torch.save"]["stall"],
        "stall_ratio_vs_dcp_async_save":
            med["snapshotter"]["stall"] / med["dcp.async_save"]["stall"],
        "min_interval_s_at_1pct": {m: max(100 * v["stall"], v["durable"]) for m, v in med.items()},
        "dedup": {"changed_share": a.change, "store_bytes_added": added,
                  "state_bytes": size, "save_s": changed_s},
        "checkpoints": [n for n in listed if n.startswith(f"b{run_id}-")],
    }  # fmt: skip
    if a.json:
        print(json.dumps(out))
    else:
        who = "the node agent" if spool.agent_spool(os.environ, url) else "a child process"
        print(f"state {a.mib} MiB in {a.tensors} tensors, {a.rounds} rounds, uploads by {who}, "
              "medians:")
        for m, v in med.items():
            print(f"  {m:15s} stall {v['stall'] * 1000:9.1f} ms   durable {v['durable']:7.2f} s"
                  f"   min interval at 1%: {out['min_interval_s_at_1pct'][m]:7.1f} s")
        print(f"  snapshotter stall / torch.save stall     = "
              f"{out['stall_ratio_vs_torch_save']:.3f}")
        print(f"  snapshotter stall / dcp.async_save stall = "
              f"{out['stall_ratio_vs_dcp_async_save']:.3f}")
        print(f"  dedup: {a.change:.0%} of tensors changed -> {added / 2**20:.1f} MiB added to "
              f"the store for a {a.mib} MiB state ({changed_s:.2f} s)")
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
