"""How a rank hands a checkpoint's bytes to whoever uploads them, and hears back.

The rank's staged state lives in memfds (staging.py). A request names extents of those memfds
(fd number, offset, length) and what to make of them: one rank's part, or the checkpoint's
commit. It is carried one of two ways:

- **to the node agent** (the job runs under snapshotter, and the request's store is the
  agent's): the rank writes `req-<id>.json` into its spool directory,
  `$SNAPSHOTTER_CKPT_SPOOL/<job>/<rank>/`; the agent claims it (renames it to
  `taken-<incarnation>-<id>.json`), reads the extents through `/proc/<pid>/fd/<fd>` (only
  memfds of this module's name, only of that rank's processes), uploads, and writes
  `res-<id>.json`. Files, not a socket: a rank frozen while it waits holds no connection CRIU
  would refuse, and a rank thawed onto another node (whose agent set a new spool directory in
  its environment) files the request again there.
- **to a child process** (no agent, or another store): `python -m snapshotter.checkpoint.upload`
  with the memfds passed down, the request on stdin and the result on stdout.

Either way the upload runs outside the rank's interpreter: the rank's thread only waits.

    request  {"op":"part","id":ID,"url":U,"name":N,"index":I,"seed":PART|"",
              "extents":[{"fd":F,"offset":O,"length":L},...]}
             {"op":"commit","id":ID,"url":U,"name":N,"parts":[PART,...],
              "extents":[...metadata...],"meta":{...}}
             {"op":"fetch","id":ID,"url":U,"name":N,"index":I,"stream":"data"|"metadata",
              "extents":[]}   a sealed checkpoint: the agent unseals with the job's key
             {"op":"publish","id":ID,"url":U,"name":CHANNEL,"extents":[...one per tensor...],
              "meta":{"version":V,"tensors":[{"name","dtype","shape"},...]}}
             {"op":"subscribe","id":ID,"url":U,"name":CHANNEL,"extents":[]}
                              weight push (agent/weights.py): answered {"ok":true,"dir":D}
    result   {"ok":true,"path":P,...} for a fetch: the verified raw stream, in a directory
             the rank removes once read
    result   {"ok":true,"raw_bytes":R,"stored_bytes":S,"uploaded_bytes":B,"seconds":T}
             {"ok":false,"code":C,"cause":M,"next_step":S}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.errors import InvalidArgument, SnapshotterError

MEMFD_NAME = "snapshotter-ckpt"
SPOOL_ENV = "SNAPSHOTTER_CKPT_SPOOL"
STORE_ENV = "SNAPSHOTTER_CKPT_STORE"
TIMEOUT_ENV = "SNAPSHOTTER_CKPT_TIMEOUT"
OPS = ("part", "commit", "fetch", "publish", "subscribe")
WEIGHT_OPS = ("publish", "subscribe")  # weight push (snapshotter.weights): the agent only
MAX_EXTENTS = 1_000_000
MAX_REQUEST_BYTES = 64 * 1024 * 1024
_POLL_S = 0.02


@dataclass(frozen=True)
class Extent:
    fd: int
    offset: int
    length: int

    def to_dict(self) -> dict[str, int]:
        return {"fd": self.fd, "offset": self.offset, "length": self.length}


@dataclass(frozen=True)
class Request:
    op: str
    id: str
    url: str
    name: str
    extents: tuple[Extent, ...]
    index: int = 0
    seed: str = ""
    parts: tuple[str, ...] = ()
    meta: Mapping[str, Any] | None = None
    stream: str = ""  # fetch: "metadata" (the checkpoint's) or "data" (part `index`'s)

    def to_json(self) -> bytes:
        d: dict[str, Any] = {
            "op": self.op, "id": self.id, "url": self.url, "name": self.name,
            "extents": [e.to_dict() for e in self.extents],
        }  # fmt: skip
        if self.op == "part":
            d.update(index=self.index, seed=self.seed)
        elif self.op == "fetch":
            d.update(index=self.index, stream=self.stream)
        elif self.op == "publish":
            d.update(meta=dict(self.meta or {}))
        elif self.op == "commit":
            d.update(parts=list(self.parts), meta=dict(self.meta or {}))
        return json.dumps(d, separators=(",", ":")).encode()

    @property
    def fds(self) -> list[int]:
        return sorted({e.fd for e in self.extents})


def new_id() -> str:
    return uuid.uuid4().hex


def parse_request(data: bytes) -> Request:
    """Check a request from a rank (untrusted: the agent runs as root) and return it.

    Raises:
        InvalidArgument: anything malformed, out of range or unknown.
    """
    if len(data) > MAX_REQUEST_BYTES:
        raise InvalidArgument(f"checkpoint request of {len(data)} bytes is too large",
                              "save fewer, larger tensors per rank")  # fmt: skip
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"checkpoint request is not JSON: {e}", _UPGRADE) from e
    if not isinstance(d, dict) or d.get("op") not in OPS:
        raise InvalidArgument("checkpoint request has no known op", _UPGRADE)
    rid = _str(d, "id")
    if not rid.isalnum() or len(rid) > 64:
        raise InvalidArgument(f"checkpoint request id {rid!r} is malformed", _UPGRADE)
    raw = d.get("extents")
    if not isinstance(raw, list) or len(raw) > MAX_EXTENTS:
        raise InvalidArgument("checkpoint request extents are malformed", _UPGRADE)
    extents = tuple(
        Extent(_int(e, "fd", 65535), _int(e, "offset", 1 << 50), _int(e, "length", 1 << 50))
        for e in raw
    )
    common = dict(op=d["op"], id=rid, url=_str(d, "url"), name=_str(d, "name"),
                  extents=extents)  # fmt: skip
    if d["op"] == "part":
        return Request(**common, index=_int(d, "index", 99_999), seed=_str(d, "seed"))
    if d["op"] == "fetch":
        stream = _str(d, "stream")
        if stream not in ("metadata", "data"):
            raise InvalidArgument(f"checkpoint fetch of unknown stream {stream!r}", _UPGRADE)
        return Request(**common, index=_int(d, "index", 99_999), stream=stream)
    if d["op"] in WEIGHT_OPS:
        meta = d.get("meta", {})
        if not isinstance(meta, dict):
            raise InvalidArgument("weights request meta is not an object", _UPGRADE)
        return Request(**common, meta=meta)
    parts = d.get("parts")
    meta = d.get("meta")
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise InvalidArgument("checkpoint commit names no parts", _UPGRADE)
    if not isinstance(meta, dict):
        raise InvalidArgument("checkpoint commit meta is not an object", _UPGRADE)
    return Request(**common, parts=tuple(parts), meta=meta)


_UPGRADE = "use the same snapshotter version in the job and on the node"


def _str(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > 4096:
        raise InvalidArgument(f"checkpoint request field {key!r} is not a string", _UPGRADE)
    return v


def _int(d: Any, key: str, top: int) -> int:
    v = d.get(key) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
        raise InvalidArgument(f"checkpoint request field {key!r} is out of range", _UPGRADE)
    return v


def ok(raw: int, stored: int, uploaded: int, seconds: float) -> dict[str, Any]:
    return {"ok": True, "raw_bytes": raw, "stored_bytes": stored, "uploaded_bytes": uploaded,
            "seconds": round(seconds, 6)}  # fmt: skip


def failed(e: BaseException) -> dict[str, Any]:
    if isinstance(e, SnapshotterError):
        return {"ok": False, "code": e.code, "cause": e.cause, "next_step": e.next_step}
    return {"ok": False, "code": "internal", "cause": f"{type(e).__name__}: {e}",
            "next_step": "see the node agent's log"}  # fmt: skip


def raise_if_failed(result: Mapping[str, Any]) -> Mapping[str, Any]:
    """Return a successful result; turn a failed one back into its typed error."""
    if result.get("ok") is True:
        return result
    cls = errors._BY_CODE.get(str(result.get("code")), errors.SnapshotterError)
    if cls.fields:
        cls = errors.SnapshotterError
    raise cls(str(result.get("cause", "checkpoint upload failed")),
              str(result.get("next_step", "")))  # fmt: skip


# -- the rank's side ------------------------------------------------------------------------


def same_store(a: str, b: str) -> bool:
    return bool(a) and a.strip().rstrip("/") == b.strip().rstrip("/")


def agent_spool(env: Mapping[str, str], url: str) -> Path | None:
    """This rank's spool directory if its node agent uploads to `url`, else None."""
    root = env.get(SPOOL_ENV, "")
    job, rank = env.get("SNAPSHOTTER_JOB_ID", ""), env.get("RANK", "")
    if not root or not job or not rank.isdigit() or not same_store(url, env.get(STORE_ENV, "")):
        return None
    return Path(root) / job / rank


def submit(request: Request) -> Mapping[str, Any]:
    """Have `request` carried out outside this interpreter; block until it is.

    Raises:
        the typed error the upload failed with (StorageUnavailable, InvalidArgument, ...).
    """
    timeout = float(os.environ.get(TIMEOUT_ENV, "3600"))
    if agent_spool(os.environ, request.url) is not None:
        return raise_if_failed(_via_agent(request, timeout))
    return raise_if_failed(_via_child(request, timeout))


def _via_agent(request: Request, timeout: float) -> Mapping[str, Any]:
    body = request.to_json()
    deadline = time.monotonic() + timeout
    filed_in: Path | None = None
    while time.monotonic() < deadline:
        # Re-read each time: a thaw onto another node gives this rank that agent's spool.
        spool = agent_spool(os.environ, request.url)
        if spool is None:
            return _via_child(request, deadline - time.monotonic())
        if spool != filed_in:
            spool.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = spool / f".req-{request.id}.tmp"
            tmp.write_bytes(body)
            os.replace(tmp, spool / f"req-{request.id}.json")
            filed_in = spool
        result = spool / f"res-{request.id}.json"
        try:
            data = result.read_bytes()
        except FileNotFoundError:
            time.sleep(_POLL_S)
            continue
        result.unlink(missing_ok=True)
        try:
            out = json.loads(data)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise errors.Internal(f"the node agent wrote a malformed result for {request.id}",
                                  "see the node agent's log")  # fmt: skip
        return out
    if filed_in is not None:
        (filed_in / f"req-{request.id}.json").unlink(missing_ok=True)
    raise errors.StorageUnavailable(
        f"the node agent did not finish checkpoint {request.name!r} ({request.op}) in "
        f"{timeout:.0f} s",
        f"check `snapshotter nodes` and the agent's log; raise {TIMEOUT_ENV} for huge states",
    )


def _via_child(request: Request, timeout: float) -> Mapping[str, Any]:
    argv = [sys.executable, "-m", "snapshotter.checkpoint.upload"]
    try:
        proc = subprocess.run(
            argv, input=request.to_json(), capture_output=True, pass_fds=request.fds,
            timeout=max(timeout, 1.0), check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise errors.StorageUnavailable(
            f"checkpoint {request.name!r} ({request.op}) did not finish in {timeout:.0f} s",
            f"check the store's reachability; raise {TIMEOUT_ENV} for huge states",
        ) from None
    try:
        out = json.loads(proc.stdout)
    except ValueError:
        out = None
    if not isinstance(out, dict):
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise errors.Internal(
            f"the checkpoint uploader exited {proc.returncode} without a result: "
            + " | ".join(tail), "run the save again; report the message if it repeats",
        )  # fmt: skip
    return out


def read_extent(fd: int, offset: int, length: int) -> bytes:
    """`length` bytes of `fd` at `offset` (a memfd: short reads mean it shrank)."""
    out = bytearray()
    while len(out) < length:
        got = os.pread(fd, length - len(out), offset + len(out))
        if not got:
            raise InvalidArgument(
                f"staged checkpoint data ended {length - len(out)} bytes early",
                "the rank released its staging memory before the upload finished",
            )
        out += got
    return bytes(out)

