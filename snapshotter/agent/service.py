"""The node agent's gRPC surface: the method tables the transport serves.

Only request decoding lives here; every decision and effect is in NodeAgent (node.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from snapshotter.agent.fencing import Fence
from snapshotter.agent.node import NodeAgent
from snapshotter.launch.env import StoreAddress
from snapshotter.launch.spec import JobSpec

Msg = dict[str, Any]

# Calls that change what runs on the node: only the newest coordinator may make them.
FENCED = frozenset({
    "OpenStore", "CloseStore", "Launch", "Prepare", "Park", "Suspend", "Abort", "Dump",
    "Resume", "DiscardUpload", "FinishFreeze", "Cancel", "DiscardFetch", "Restore", "Upload",
    "Fetch", "KeepFreeze",
})  # fmt: skip


def agent_service(
    agent: NodeAgent, fence: Fence | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's gRPC surface: unary and streaming method tables. With a `fence`, calls in
    FENCED must carry a fencing token no older than the newest seen (agent/fencing.py)."""

    def spec_of(req: Msg) -> JobSpec:
        return JobSpec.from_dict(req["spec"])

    def store_of(req: Msg) -> StoreAddress | None:
        s = req.get("store")
        return None if not s else StoreAddress(host=str(s["host"]), port=int(s["port"]))

    unary = {
        "Ping": lambda req: {
            "node": agent.settings.name,
            "pid": os.getpid(),
            "host": agent.settings.host,
            "incarnation": agent.incarnation,
            "resources": agent.resources().to_dict(),
            "running_jobs": agent.running_jobs(),
        },
        "OpenStore": lambda req: agent.open_store(
            req["job_id"], req["python"], dict(req.get("env", {}))
        ),
        "CloseStore": lambda req: agent.close_store(req["job_id"]),
        "Launch": lambda req: agent.launch(
            spec_of(req), int(req.get("node_rank", 0)), store_of(req)
        ),
        "Prepare": lambda req: agent.prepare(
            req["job_id"], req["freeze_id"], float(req["timeout"])
        ),
        "Park": lambda req: agent.park(
            req["job_id"], req["freeze_id"], dict(req["targets"]), float(req["timeout"])
        ),
        "Suspend": lambda req: agent.suspend(
            req["job_id"], req["freeze_id"], float(req["timeout"])
        ),
        "Abort": lambda req: agent.abort(req["job_id"], req["freeze_id"]),
        "KeepFreeze": lambda req: agent.keep_freeze(req["job_id"], req["freeze_id"]),
        "Dump": lambda req: agent.dump(req["job_id"], req["freeze_id"]),
        "Resume": lambda req: agent.resume(req["job_id"], req["freeze_id"], float(req["timeout"])),
        "DiscardUpload": lambda req: agent.discard_upload(req["job_id"], req["freeze_id"]),
        "FinishFreeze": lambda req: agent.finish_freeze(
            req["job_id"], req["freeze_id"], bool(req["stop"])
        ),
        "Status": lambda req: agent.status(req["job_id"]),
        "Jobs": lambda req: agent.jobs(),
        "Wait": lambda req: agent.wait(req["job_id"], float(req.get("timeout", 10))),
        "Cancel": lambda req: agent.cancel(req["job_id"]),
        "DiscardFetch": lambda req: agent.discard_fetch(req["op"]),
        "Restore": lambda req: agent.restore(
            req["op"],
            spec_of(req),
            list(req["ranks"]),
            int(req.get("node_rank", 0)),
            float(req.get("timeout", 120)),
            store_of(req),
            req.get("epoch"),
        ),
    }
    streaming = {
        "Upload": lambda req: agent.upload(req["job_id"], req["freeze_id"], req["snapshot_id"]),
        "Fetch": lambda req: agent.fetch(req["snapshot_id"], list(req["streams"])),
        "Logs": lambda req: agent.logs(
            req["job_id"], req.get("rank"), int(req.get("offset", 0)), bool(req.get("follow"))
        ),
    }
    if fence is not None:
        unary = {k: _fenced(fence, fn) if k in FENCED else fn for k, fn in unary.items()}
        streaming = {k: _fenced(fence, fn) if k in FENCED else fn for k, fn in streaming.items()}
    return unary, streaming


def _fenced(fence: Fence, fn: Callable[[Msg], Any]) -> Callable[[Msg], Any]:
    def call(req: Msg) -> Any:
        fence.check(req.get("fence"))
        return fn(req)

    return call
