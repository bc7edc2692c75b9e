"""A job using new_group subgroups, DeviceMesh groups and dist.* collectives directly.

usage: subgroups.py OUT_PATH [STEPS]
Prints "step N value V" per step; rank 0 writes the sha256 of the final state to OUT_PATH.
"""

import hashlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def main() -> None:
    out_path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = dist.new_group([0])  # rank 1 is not a member: group keys must still agree
    pair = dist.new_group(list(range(world)))
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")

    torch.manual_seed(rank)
    state = torch.randn(64)
    for step in range(1, steps + 1):
        t = state.clone()
        dist.all_reduce(t, group=pair)
        state = 0.5 * state + 0.25 * t / world + 0.01 * torch.randn(64)
        b = torch.zeros(8) if rank else state[:8].clone()
        dist.broadcast(b, src=0, group=tp)
        state[8:16] += 0.001 * b
        if rank == 0:
            s = state[:4].clone()
            dist.all_reduce(s, group=solo)
            state[:4] = s
        out = [torch.zeros(4) for _ in range(world)]
        dist.all_gather(out, state[:4].clone())
        state[16:20] += 0.001 * torch.stack(out).sum(0)
        if step % 7 == 0:  # point-to-point, async handles
            peer = 1 - rank
            got = torch.zeros(4)
            reqs = [dist.isend(state[:4].clone(), peer), dist.irecv(got, peer)]
            for req in reqs:
                req.wait()
            state[20:24] += 0.001 * got
        if step % 10 == 0:
            dist.barrier(group=pair)
        print(f"step {step} value {state.sum().item():.6f}", flush=True)

    final = [torch.zeros(64) for _ in range(world)]
    dist.all_gather(final, state)
    if rank == 0:
        h = hashlib.sha256(torch.cat(final).numpy().tobytes()).hexdigest()
        with open(out_path, "w") as f:
            f.write(h)
    dist.barrier()
    dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    main()
