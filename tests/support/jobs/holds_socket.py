"""A job that keeps a connection of its own open (like a metrics client) while it trains.

`holds_socket.py tcp`: a TCP connection to the store's address. The hook sees a TCP socket it
does not own at suspend and refuses the freeze.
`holds_socket.py unix PATH`: a unix stream connection to a listener outside the job. CRIU
cannot dump half of a connection whose peer is outside the tree, so the dump fails.
Either way the freeze must fail cleanly and the job go on.
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[1] == "tcp":
    conn = socket.create_connection((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
else:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[2])
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
