"""How the services (coordinator, agent, keeper, embedded daemon, gateway) log: text lines by
default, or one JSON object per line for log pipelines (`--log-format json`), at a chosen
level (`--log-level`). The flags set SNAPSHOTTER_LOG_FORMAT / SNAPSHOTTER_LOG_LEVEL, so the
processes a service starts (the agent under its keeper) log the same way. Standard library
only: the keeper uses it."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, TextIO

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", "pid", "thread"[, "exception"]} per record."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(stream: TextIO | None = None) -> None:
    """Logging to stderr (or `stream`) as SNAPSHOTTER_LOG_FORMAT / SNAPSHOTTER_LOG_LEVEL say
    (text, info)."""
    fmt = os.environ.get("SNAPSHOTTER_LOG_FORMAT", "text")
    level = os.environ.get("SNAPSHOTTER_LOG_LEVEL", "info")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level in LEVELS else logging.INFO)
