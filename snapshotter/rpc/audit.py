"""The append-only audit log of a service: who did what, to which job or snapshot, and how it
ended. One JSON object a line:

    {"time": epoch s, "who": name, "role": ..., "tenant": T | null, "via": token|certificate|
     unix|insecure, "method": "Freeze", "target": {"job_id": ...}, "outcome": "ok" | an error
     code, "cause": "" | the error's cause}

Recorded: every call that acts (rights OPERATE and ADMINISTER), and every call refused for who
made it (unauthenticated, permission denied), whatever it asked. Reads (status, logs, lists)
are not: a CLI polls them every second. The file is opened O_APPEND (each line one write, so
lines of concurrent calls never interleave) and 0600; nothing here ever truncates or rewrites
it (rotate it with logrotate's copytruncate off: move it away and the next line makes a new one).
Requests are logged by their target ids only: no environment, script arguments or key material.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from snapshotter.rpc.auth import Identity

TARGET_FIELDS = ("job_id", "snapshot_id", "node", "to", "rank", "tenant", "stop", "force")
REFUSALS = ("unauthenticated", "permission_denied")


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def record(self, who: Identity | None, method: str, request: Any, outcome: str,
               cause: str = "") -> None:  # fmt: skip
        line = {
            "time": round(time.time(), 3),
            "who": who.name if who else None,
            "role": who.role.value if who else None,
            "tenant": who.tenant if who else None,
            "via": who.via if who else None,
            "method": method.rsplit("/", 1)[-1],
            "target": target(request),
            "outcome": outcome,
            "cause": cause,
        }
        data = (json.dumps(line, sort_keys=True) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


def target(request: Any) -> dict[str, Any]:
    """The ids a request names (fields of TARGET_FIELDS that are set), nothing else."""
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    out: dict[str, Any] = {}
    for name in TARGET_FIELDS:
        if name in fields:
            value = getattr(request, name)
            if value not in ("", 0, False, None):
                out[name] = value
    return out


def read(path: Path) -> list[dict[str, Any]]:
    """Every line of an audit log (tests, `snapshotter audit-log`)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
