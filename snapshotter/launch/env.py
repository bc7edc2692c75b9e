"""The environment a rank sees: torchrun's variables, computed as a pure function.

Scripts written for torchrun read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and the TORCHELASTIC_* family; they must find the same here. The rendezvous
server (a c10d TCPStore) is hosted outside the ranks by the node agent, exactly like torchrun's
agent store, so every rank is a client (TORCHELASTIC_USE_AGENT_STORE=True). No I/O here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Fixed fd numbers of the agent<->rank control pipes. CRIU restores fds at their numbers, so
# these stay valid across a thaw.
CTL_IN_FD = 3
CTL_OUT_FD = 4


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    local_world_size: int
    nnodes: int


@dataclass(frozen=True)
class RdzvAddress:
    """Where the job's rendezvous server (its c10d TCPStore) listens."""

    host: str
    port: int


def placements(nnodes: int, nproc_per_node: int, node_rank: int) -> list[RankPlacement]:
    """Ranks of one node, numbered as torchrun numbers them (node-major)."""
    world = nnodes * nproc_per_node
    return [
        RankPlacement(
            rank=node_rank * nproc_per_node + lr,
            local_rank=lr,
            node_rank=node_rank,
            world_size=world,
            local_world_size=nproc_per_node,
            nnodes=nnodes,
        )
        for lr in range(nproc_per_node)
    ]


def rank_env(
    base: Mapping[str, str],
    p: RankPlacement,
    rdzv: RdzvAddress,
    job_id: str,
    node_env: Mapping[str, str] | None = None,
    error_file: str | None = None,
) -> dict[str, str]:
    """The full environment of one rank: the caller's, then torchrun's variables, then the
    node's own network settings (which must win: they describe the node the rank runs on).
    `error_file` is where the rank's `@record` writes its root cause (launch/rootcause.py)."""
    env = dict(base)
    env.update(
        {
            "RANK": str(p.rank),
            "LOCAL_RANK": str(p.local_rank),
            "GROUP_RANK": str(p.node_rank),
            "ROLE_RANK": str(p.rank),
            "ROLE_NAME": base.get("SNAPSHOTTER_ROLE", "default"),  # run --role
            "WORLD_SIZE": str(p.world_size),
            "LOCAL_WORLD_SIZE": str(p.local_world_size),
            "ROLE_WORLD_SIZE": str(p.world_size),
            "GROUP_WORLD_SIZE": str(p.nnodes),
            "MASTER_ADDR": rdzv.host,
            "MASTER_PORT": str(rdzv.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": job_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "SNAPSHOTTER_JOB_ID": job_id,
            "SNAPSHOTTER_CTL_IN": str(CTL_IN_FD),
            "SNAPSHOTTER_CTL_OUT": str(CTL_OUT_FD),
        }
    )
    # torchrun caps OpenMP threads when it runs several ranks on one node; so do we.
    if p.local_world_size > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    if error_file:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if node_env:
        env.update(node_env)
    return env


def resume_env(rdzv: RdzvAddress, node_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a rank must overwrite after a thaw: values restored from the old node lose."""
    env = {"MASTER_ADDR": rdzv.host, "MASTER_PORT": str(rdzv.port)}
    if node_env:
        env.update(node_env)
    return env


def rank_argv(python: str, script: str, script_args: list[str], module: bool) -> list[str]:
    """The rank runs the user's script through the bootstrap that installs the hook."""
    head = [python, "-m", "snapshotter.hook.bootstrap"]
    if module:
        return [*head, "-m", script, *script_args]
    return [*head, script, *script_args]
