"""The control protocol between a node agent and the hook inside each of its ranks.

One JSON object per line, on two pipes the agent owns (the rank's fds 3 and 4, which CRIU
keeps at the same numbers across a dump and restore)::

    agent -> rank (command)                         rank -> agent (reply)
    {"op":"ping"}                                   {"op":"pong","pid":P,"rank":R,"native":B}
    {"op":"prepare","freeze":ID}                    {"op":"counts","freeze":ID,
                                                     "counts":{GROUP:n}}
    {"op":"park","freeze":ID,"targets":{GROUP:n}}   {"op":"parked","freeze":ID,
                                                     "at":{"group":GROUP,"seq":n} | null}
    {"op":"suspend","freeze":ID}                    {"op":"suspended","freeze":ID}
    {"op":"resume","freeze":ID,"epoch":E,
     "rdzv":{"host":H,"port":P},"env":{K:V}}        {"op":"resumed","freeze":ID}
    {"op":"abort","freeze":ID}                      {"op":"aborted","freeze":ID}
    {"op":"progress","query":Q}                     {"op":"progress","query":Q,"steps":N,
                                                     "counts":{GROUP:n},"state":S}
    any command that fails                          {"op":"error","freeze":ID,"message":M}

`parked` is sent asynchronously, by whichever rank thread made the rank quiesced. Replies
are matched by op and freeze id; a reply of an earlier freeze is stale and dropped.

`progress` reads what the rank did without disturbing it, whenever the control thread is free
(the agent asks only between freezes and thaws): the optimizer steps taken (every optimizer's
`step()`, counted by a global post-hook) and the collectives issued per group, the barrier's
own counters. It carries no timestamps: keeping the time of each count's last change would
cost every collective a clock read, and whoever samples twice knows how long a count stood
still. Its reply is matched by the query number Q, not by a freeze id, so it can never be
taken for (or take) a freeze's reply.

Both ends build and read messages only through this module; it imports only the standard
library (the hook runs in the job's interpreter, which may have nothing else of ours).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Msg = dict[str, Any]

# Commands and the reply each expects.
PING, PREPARE, PARK, SUSPEND, RESUME, ABORT, PROGRESS = (
    "ping",
    "prepare",
    "park",
    "suspend",
    "resume",
    "abort",
    "progress",
)
REPLY_TO = {
    PING: "pong",
    PREPARE: "counts",
    PARK: "parked",
    SUSPEND: "suspended",
    RESUME: "resumed",
    ABORT: "aborted",
    PROGRESS: "progress",
}
ERROR = "error"
# Set in the rank's environment at each resume, to the resume's epoch: what registered with
# the node agent (a weights subscription) registers again, with the agent it runs under now.
RESUMED_ENV = "SNAPSHOTTER_RESUMED"


class ProtocolError(ValueError):
    """A line that is not a well-formed message of this protocol."""


def encode(msg: Mapping[str, Any]) -> bytes:
    return (json.dumps(msg, separators=(",", ":")) + "\n").encode()


class LineDecoder:
    """Splits a byte stream into messages; malformed lines raise ProtocolError one by one."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines in `data` (and what came before it), without newlines."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [ln for ln in lines if ln.strip()]


def decode(line: bytes) -> Msg:
    try:
        msg = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not JSON: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ProtocolError("a message must be a JSON object with a string 'op'")
    return msg


# ---- commands (agent -> rank) -------------------------------------------------------------


def ping() -> Msg:
    return {"op": PING}


def prepare(freeze: str) -> Msg:
    return {"op": PREPARE, "freeze": freeze}


def park(freeze: str, targets: Mapping[str, int]) -> Msg:
    return {"op": PARK, "freeze": freeze, "targets": {str(k): int(v) for k, v in targets.items()}}


def suspend(freeze: str) -> Msg:
    return {"op": SUSPEND, "freeze": freeze}


def resume(freeze: str, epoch: str, host: str, port: int, env: Mapping[str, str]) -> Msg:
    return {
        "op": RESUME,
        "freeze": freeze,
        "epoch": epoch,
        "rdzv": {"host": host, "port": int(port)},
        "env": dict(env),
    }


def abort(freeze: str) -> Msg:
    return {"op": ABORT, "freeze": freeze}


def progress(query: int, where: bool = False) -> Msg:
    """Ask for a progress report; `where`: also where each of the rank's threads is (asked
    for a rank that did not park, to say what it waits on)."""
    msg: Msg = {"op": PROGRESS, "query": int(query)}
    if where:
        msg["where"] = True
    return msg


def targets_of(msg: Msg) -> dict[str, int]:
    """The park targets of a `park` command (ProtocolError if malformed)."""
    targets = msg.get("targets") or {}
    if not isinstance(targets, dict):
        raise ProtocolError("targets must be an object {group: seq}")
    try:
        return {str(k): int(v) for k, v in targets.items()}
    except (TypeError, ValueError) as e:
        raise ProtocolError(f"targets must map groups to integers: {e}") from e


def rdzv_of(msg: Msg) -> tuple[str, int, str, dict[str, str]]:
    """(host, port, epoch, env) of a `resume` command (ProtocolError if malformed)."""
    rdzv = msg.get("rdzv")
    env = msg.get("env") or {}
    if not isinstance(rdzv, dict) or not isinstance(env, dict):
        raise ProtocolError("resume needs rdzv {host, port} and env {name: value}")
    try:
        host, port = str(rdzv["host"]), int(rdzv["port"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"resume's rdzv must be {{host, port}}: {e}") from e
    return host, port, str(msg.get("epoch", "")), {str(k): str(v) for k, v in env.items()}


# ---- replies (rank -> agent) --------------------------------------------------------------


def pong(pid: int, rank: int, native: bool = False) -> Msg:
    """`native`: the rank's collectives take the hook's native path (snapshotter/hook/native.py)."""
    return {"op": "pong", "pid": pid, "rank": rank, "native": native}


def counts(freeze: str, issued: Mapping[str, int]) -> Msg:
    return {"op": "counts", "freeze": freeze, "counts": dict(issued)}


def parked(freeze: str, group: str | None, seq: int | None) -> Msg:
    at = None if group is None else {"group": group, "seq": seq}
    return {"op": "parked", "freeze": freeze, "at": at}


def done(op: str, freeze: str) -> Msg:
    """The plain acknowledgement of `op` (suspend, resume, abort)."""
    return {"op": REPLY_TO[op], "freeze": freeze}


def error(freeze: str, message: str) -> Msg:
    return {"op": ERROR, "freeze": freeze, "message": message}


def progress_report(
    query: int,
    steps: int,
    issued: Mapping[str, int],
    state: str = "",
    in_flight_s: float = 0.0,
    telemetry: Mapping[str, Any] | None = None,
    where: Sequence[str] | None = None,
) -> Msg:
    """The reply to `progress` command `query`; `state` is the barrier's (idle, holding, armed,
    parked, suspended): a restarted agent reads it to finish what its predecessor left;
    `in_flight_s`: how long the rank's oldest collective still in flight has been;
    `telemetry`: hook/telemetry.py's `summary` of its recent steps and collective latencies;
    `where`: one line per thread of the rank (hook/stacks.py), when asked for."""
    msg = {"op": PROGRESS, "query": int(query), "steps": int(steps), "counts": dict(issued),
           "state": str(state), "in_flight_s": float(in_flight_s)}  # fmt: skip
    if telemetry is not None:
        msg["telemetry"] = dict(telemetry)
    if where is not None:
        msg["where"] = [str(w) for w in where]
    return msg


@dataclass(frozen=True)
class Timing:
    """A group's (or channel's) recent collectives: how many completed, and the mean and
    median seconds from issue to completion over the latest `window` of them."""

    done: int
    window: int
    mean_s: float
    p50_s: float
    # The latest (seq, seconds) by sequence number on the group, the same on every member.
    recent: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Progress:
    """What a `progress` reply says: optimizer steps taken and collectives issued per group."""

    query: int
    steps: int
    counts: dict[str, int]
    state: str = ""  # the barrier's state; "" from a hook older than the field
    in_flight_s: float = 0.0  # its oldest collective still in flight, this long
    step_s: float = 0.0  # the median of its latest optimizer steps' durations (0: unknown)
    steps_window: int = 0  # how many durations that median is of
    timings: dict[str, Timing] = field(default_factory=dict)
    where: tuple[str, ...] = ()  # where each thread is, when asked for (`progress(where=)`)


def query_of(msg: Msg) -> int:
    """The query number of a `progress` command or reply (ProtocolError if malformed)."""
    try:
        return int(msg["query"])
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"progress needs an integer query number: {e}") from e


MAX_WHERE = 32  # threads described; a line is cut at MAX_WHERE_CHARS
MAX_WHERE_CHARS = 400


def _where_of(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(w, str) for w in raw):
        raise ProtocolError("progress 'where' must be a list of strings")
    return tuple(w[:MAX_WHERE_CHARS] for w in raw[:MAX_WHERE])


def progress_of(msg: Msg) -> Progress:
    """The content of a `progress` reply (ProtocolError if malformed)."""
    if msg.get("op") != PROGRESS:
        raise ProtocolError(f"not a progress reply: op {msg.get('op')!r}")
    counts = msg.get("counts")
    if not isinstance(counts, dict):
        raise ProtocolError("progress counts must be an object {group: issued}")
    tele = msg.get("telemetry") or {}
    groups = tele.get("groups") if isinstance(tele, dict) else None
    if not isinstance(tele, dict) or not isinstance(groups or {}, dict):
        raise ProtocolError("progress telemetry must be an object with groups {key: timing}")
    try:
        timings = {
            str(k): Timing(done=int(v["done"]), window=int(v["window"]),
                           mean_s=float(v["mean_s"]), p50_s=float(v["p50_s"]),
                           recent=tuple((int(q), int(us) / 1e6)
                                        for q, us in v.get("recent") or ()))  # fmt: skip
            for k, v in (groups or {}).items()
        }
        return Progress(
            query=query_of(msg),
            steps=int(msg["steps"]),
            counts={str(k): int(v) for k, v in counts.items()},
            state=str(msg.get("state", "")),
            in_flight_s=float(msg.get("in_flight_s", 0.0)),
            step_s=float(tele.get("step_s", 0.0)),
            steps_window=int(tele.get("steps_window", 0)),
            timings=timings,
            where=_where_of(msg.get("where")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"progress needs integer steps and counts: {e}") from e
