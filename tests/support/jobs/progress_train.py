"""A gloo job with an optimizer that knows nothing of snapshotter, and trains slowly.

usage: progress_train.py [STEPS] [PAUSE_S]
Per step: two allreduces on the default group (the gradients of weight and bias), then one
optimizer step, then "step N" on stdout and a pause (default 0.02s: light on a shared machine).
SLOW_RANK=R:S in the environment makes rank R a straggler: it works S seconds more a step,
before its allreduces (its peers wait for it in them).
"""

import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    slow_rank, _, slow_s = os.environ.get("SLOW_RANK", "-1:0").partition(":")
    extra = float(slow_s) if dist.get_rank() == int(slow_rank) else 0.0
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        if extra:
            time.sleep(extra)
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        opt.step()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(pause)
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
