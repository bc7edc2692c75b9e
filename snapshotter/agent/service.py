"""The node agent's gRPC surface: the method tables the transport serves.

Only request decoding lives here; every decision and effect is in NodeAgent (node.py).
"""

from __future__ import annotations

import os
from typing import Any

from snapshotter.agent.node import NodeAgent
from snapshotter.launch.spec import JobSpec

Msg = dict[str, Any]


def agent_service(agent: NodeAgent) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's gRPC surface: unary and streaming method tables."""

    def spec_of(req: Msg) -> JobSpec:
        return JobSpec.from_dict(req["spec"])

    unary = {
        "Ping": lambda req: {
            "node": agent.settings.name,
            "pid": os.getpid(),
            "host": agent.settings.host,
        },
        "Launch": lambda req: agent.launch(spec_of(req), int(req.get("node_rank", 0))),
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
        ),
    }
    streaming = {
        "Upload": lambda req: agent.upload(req["job_id"], req["freeze_id"], req["snapshot_id"]),
        "Fetch": lambda req: agent.fetch(req["snapshot_id"], list(req["streams"])),
        "Logs": lambda req: agent.logs(
            req["job_id"], req.get("rank"), int(req.get("offset", 0)), bool(req.get("follow"))
        ),
    }
    return unary, streaming
