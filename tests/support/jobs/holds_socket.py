"""A job that keeps a connection of its own open while it trains.

`holds_socket.py tcp`: a TCP connection to the store's address opened by C code (libc's
socket/connect through ctypes), as a C library would: neither the hook's nor the job's Python
code's, so the hook cannot know what it is and refuses the freeze, naming it. (A connection
the job's Python code opens is kept by a snapshot and restored closed.)
`holds_socket.py unix PATH`: a unix stream connection to a listener outside the job. CRIU
cannot dump half of a connection whose peer is outside the tree, so the dump fails.
Either way the freeze must fail cleanly and the job go on.
"""

import ctypes
import os
import socket
import struct
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[1] == "tcp":
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    addr = struct.pack("=HH4s8x", socket.AF_INET, socket.htons(int(os.environ["MASTER_PORT"])),
                       socket.inet_aton(os.environ["MASTER_ADDR"]))  # fmt: skip
    assert libc.connect(fd, addr, len(addr)) == 0, ctypes.get_errno()
    close = lambda: os.close(fd)  # noqa: E731 - never wrapped in a Python socket
else:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sys.argv[2])
    close = conn.close
total = torch.zeros(1)
for step in range(1, 201):
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    total += t
    print(f"rank {rank} step {step} total {total.item()}", flush=True)
    time.sleep(0.05)
close()
print(f"rank {rank} done total {total.item()}", flush=True)
dist.destroy_process_group()
