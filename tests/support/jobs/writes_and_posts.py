"""A 2-rank gloo DDP job of the kind people run: it writes its metrics to files it keeps open
('w' CSV, 'r+' summary, 'a' event log, 'a+' history), and with --post it posts every step to an
HTTP service over one keep-alive connection, reconnecting when the connection is reset.

usage: writes_and_posts.py --out OUT --files DIR [--post URL] [--hold FILE] [--steps N]
                           [--step-sleep S]
Prints "rank R step N loss L" per step; rank 0 writes the sha256 of the final parameters to
OUT, and the number of connection resets it saw.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import time
import urllib.parse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Poster:
    """One keep-alive connection; a reset (a connection restored closed) means reconnect."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port, self.path = u.hostname or "", u.port or 80, u.path or "/"
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        self.resets = 0

    def post(self, body: str) -> None:
        for _ in range(3):
            try:
                self.conn.request("POST", self.path, body=body.encode())
                self.conn.getresponse().read()
                return
            except (OSError, http.client.HTTPException):
                self.resets += 1
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        raise RuntimeError(f"could not post to {self.host}:{self.port}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--files", required=True)
    ap.add_argument("--post", default="")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--step-sleep", type=float, default=0.03)
    ap.add_argument("--hold", default="", help="a file to keep open read-only (a data set)")
    a = ap.parse_args()
    held = open(a.hold, "rb") if a.hold else None  # noqa: SIM115 - held for the whole run
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lossf = nn.BCEWithLogitsLoss()
    torch.manual_seed(100 + rank)

    files = {}
    if rank == 0:
        os.makedirs(a.files, exist_ok=True)
        rplus = os.path.join(a.files, "summary.txt")
        open(rplus, "w").close()
        files = {
            "csv": open(os.path.join(a.files, "metrics.csv"), "w"),
            "summary": open(rplus, "r+"),
            "events": open(os.path.join(a.files, "events.log"), "a"),
            "history": open(os.path.join(a.files, "history.log"), "a+"),
        }
        files["csv"].write("step,loss\n")
    poster = Poster(a.post) if a.post and rank == 0 else None

    for step in range(1, a.steps + 1):
        i = (step * 64 + rank * 32) % 4096
        opt.zero_grad()
        loss = lossf(model(x[i : i + 32]), y[i : i + 32])
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        if rank == 0:
            files["csv"].write(f"{step},{loss.item():.6f}\n")
            files["summary"].seek(0)  # r+: rewritten in place every step
            files["summary"].write(f"last step {step} loss {loss.item():.6f}\n")
            files["events"].write(f"step {step} done\n")
            files["history"].write(f"{step} {loss.item():.6f}\n")
            for f in files.values():
                f.flush()
        if poster is not None:
            poster.post(json.dumps({"step": step, "loss": round(loss.item(), 6)}))
        time.sleep(a.step_sleep)

    h = hashlib.sha256()
    for p in model.module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"digest": h.hexdigest(), "resets": poster.resets if poster else 0}, f)
    dist.barrier()
    dist.destroy_process_group()
    if held is not None:
        held.close()


if __name__ == "__main__":
    main()
