"""torchrun's error file: where a rank's `@record` writes the exception that ended it, and that
file read back as torchrun reads it, so a failed job names its root cause (the traceback).

`torch.distributed.elastic.multiprocessing.errors.record` writes, on an uncaught exception, to
the path in TORCHELASTIC_ERROR_FILE (ErrorHandler.record_exception):

    {"message": {"message": "<Type>: <str(e)>",
                 "extraInfo": {"py_callstack": "<traceback.format_exc()>", "timestamp": "<int>"}}}

A file dumped by a nanny process may hold the message as a plain string instead, with the
timestamp beside it: {"message": "<text>", "timestamp": "<int>"}. torchrun's summary
(ChildFailedError.format_msg) shows the callstack, else the message; so does `error` here.

The rank's file lies in its sandbox's init directory unless the job sets TORCHELASTIC_ERROR_FILE
itself: that directory is private to the sandbox, visible inside it (a sandbox sees the host's
mounts), and a restore recreates it at the same path on whichever node the rank thaws, under
whatever job id: the restored rank's environment still names it.

Pure: no I/O here (the agent reads the file: agent/runtime.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

VAR = "TORCHELASTIC_ERROR_FILE"
FILE_NAME = "torchelastic-error.json"  # in the rank's sandbox init directory
MAX_ERROR_BYTES = 8 * 1024  # what a RankState carries of the error text
MAX_FILE_BYTES = 4 * 1024 * 1024  # read at most this much of a rank's error file
_CUT = "\n  ... ({} bytes cut) ...\n"


@dataclass(frozen=True)
class RootCause:
    """What ended a rank, as its `@record` wrote it."""

    error: str  # the callstack as torchrun's summary shows it (it ends with the message)
    time: float  # epoch seconds of the failure by the rank's clock; 0 if the file has none


def error_file(env: Mapping[str, str], init_cwd: str) -> str:
    """The file a rank's `@record` writes to: the job's own TORCHELASTIC_ERROR_FILE if it sets
    one, else FILE_NAME in the rank's sandbox init directory."""
    return env.get(VAR) or os.path.join(init_cwd, FILE_NAME)


def parse(data: bytes | str) -> RootCause | None:
    """The root cause in the content of an error file; None if it is not torch's format."""
    try:
        doc = json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError alike
        return None
    if not isinstance(doc, dict) or "message" not in doc:
        return None
    message = doc["message"]
    if isinstance(message, str):
        return RootCause(clip(message), _seconds(doc.get("timestamp")))
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    text = message.get("message")
    text = text if isinstance(text, str) else ""
    stack = extra.get("py_callstack")
    stack = stack.rstrip("\n") if isinstance(stack, str) else ""
    if not stack:
        error = text or "<N/A>"
    elif text and text not in stack:  # recorded outside an except block: no traceback of it
        error = f"{text}\n{stack}"
    else:
        error = stack
    return RootCause(clip(error), _seconds(extra.get("timestamp")))


def clip(text: str, limit: int = MAX_ERROR_BYTES) -> str:
    """`text` in at most `limit` UTF-8 bytes: its start and its end (a traceback's outer
    frames and the exception), with what was cut between them said."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    marker_room = len(_CUT.format(len(raw)).encode())
    keep = max(limit - marker_room, 0)
    head, tail = keep // 4, keep - keep // 4
    cut = len(raw) - head - tail
    return (
        raw[:head].decode(errors="ignore")
        + _CUT.format(cut)
        + raw[len(raw) - tail :].decode(errors="ignore")
    )


def _seconds(value: object) -> float:
    """torch writes str(int(time.time())); anything else is no time."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return 0.0
    try:
        t = float(value)
    except ValueError:
        return 0.0
    return t if math.isfinite(t) and t > 0 else 0.0
