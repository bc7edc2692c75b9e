"""A job that keeps a TCP connection of its own open (like a metrics client) while it trains:
CRIU refuses to dump an established connection, so a freeze must fail cleanly and the job go on.
"""

import os
import socket
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
conn = socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
total = torch.zeros(1)
for step in range(1, 201):
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    total += t
    print(f"rank {rank} step {step} total {total.item()}", flush=True)
    time.sleep(0.05)
conn.close()
print(f"rank {rank} done total {total.item()}", flush=True)
dist.destroy_process_group()
