"""Per-rank sandboxes and the CRIU driver that dumps and restores them.

- spawn.py: start a rank under `snapinit` (pid 1 of its own PID namespace), agent-owned pipes.
- criu.py: dump a sandbox's tree to images, restore it (with new pipes) as a new sandbox.
- initbin.py: find or build the `snapinit` binary (csrc/snapinit.c).
"""

from snapshotter.sandbox.criu import DumpStats, criu_binary, dump, restore
from snapshotter.sandbox.initbin import snapinit_path
from snapshotter.sandbox.spawn import RankIO, Sandbox, become_subreaper, spawn

__all__ = [
    "DumpStats",
    "RankIO",
    "Sandbox",
    "become_subreaper",
    "criu_binary",
    "dump",
    "restore",
    "snapinit_path",
    "spawn",
]
