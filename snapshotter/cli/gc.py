"""`snapshotter gc`: report, and with --delete remove, orphaned snapshots (chunks of freezes
that never committed).

The coordinator decides and deletes (coordinator/gc.py, via its "Gc" RPC): only it knows which
snapshots its freezes are writing right now. This module only parses the flags and renders the
reply; it never touches the store itself.
"""

from __future__ import annotations

import argparse
import json
import sys

from snapshotter import errors
from snapshotter.cli.output import Msg, human_bytes, table
from snapshotter.coordinator.gc import DEFAULT_MIN_AGE_S
from snapshotter.rpc.client import Client
from snapshotter.rpc.convert import plain
from snapshotter.v1 import coordinator_pb2

# Listing a large store and deleting thousands of chunks takes longer than a plain call.
GC_TIMEOUT_S = 900.0


def _seconds(v: str) -> float:
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not 0 <= s < float("inf"):
        raise argparse.ArgumentTypeError(f"{v!r} is not a non-negative number of seconds")
    return s


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add `gc [--delete] [--min-age SECONDS] [--json]`; the caller sets its handler."""
    p = subparsers.add_parser(
        "gc",
        help="find (and with --delete remove) chunks of snapshots that were never committed",
        description=(
            "List orphaned snapshots: chunks under snapshots/<id>/ with no manifest, left by "
            "freezes that failed or were killed mid-upload. They are never thawable. Without "
            "--delete nothing is removed. An orphan is deleted only if no freeze of this "
            "coordinator is writing it and its newest object is older than --min-age (a "
            "freeze by another coordinator looks exactly like an orphan until it commits)."
        ),
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--delete", action="store_true", help="delete the collectable orphans (default: only list)"
    )
    p.add_argument(
        "--min-age",
        type=_seconds,
        default=DEFAULT_MIN_AGE_S,
        metavar="SECONDS",
        help="grace period: keep orphans written to in the last SECONDS; make it longer than "
        f"your longest freeze upload (default {DEFAULT_MIN_AGE_S:.0f})",
    )
    return p


def request(a: argparse.Namespace) -> coordinator_pb2.GcRequest:
    """The Gc request for parsed `gc` arguments."""
    return coordinator_pb2.GcRequest(delete=bool(a.delete), min_age_s=float(a.min_age))


def run(a: argparse.Namespace, client: Client) -> int:
    """The `gc` handler: ask the coordinator, print the result, return the exit code (that of
    StorageUnavailable when a delete left objects behind)."""
    result = plain(client.stub.Gc(request(a), timeout=GC_TIMEOUT_S))
    sys.stdout.write(render(result, a.json) + "\n")
    sys.stdout.flush()
    ck = result.get("checkpoints") or {}
    if result["summary"]["failed"] or (result.get("chunks") or {}).get("failed") or \
            (ck.get("summary") or {}).get("failed") or (ck.get("chunks") or {}).get("failed"):
        print(
            "error: some orphans or shared chunks could not be deleted (see above)\n"
            "  next step: check delete permissions on the store, then run `snapshotter gc "
            "--delete` again",
            file=sys.stderr,
        )
        return errors.StorageUnavailable.exit_code
    return 0


def render(result: Msg, as_json: bool) -> str:
    """The `gc` reply (a plain GcReport) as one JSON document, or as a table of
    orphans followed by a one-line summary (always the last line)."""
    if as_json:
        return json.dumps(result, default=str)
    orphans = result["orphans"]
    chunks = _chunks_line(result)
    summary = (chunks + "\n" if chunks else "") + _checkpoints_lines(result) + \
        _summary_line(result)  # fmt: skip
    if not orphans:
        return summary
    rows = [
        [
            o["snapshot_id"],
            str(o["objects"]),
            human_bytes(o["bytes"]),
            human_age(o["newest_age_s"]),
            _action(o["action"], result["delete"]),
            "" if o["action"] in ("collectable", "deleted") else _first_line(o["reason"]),
        ]
        for o in orphans
    ]
    text = table(rows, ["SNAPSHOT", "OBJECTS", "BYTES", "AGE", "ACTION", "WHY"])
    return f"{text}\n{summary}"


def _chunks_line(result: Msg) -> str:
    c = result.get("chunks") or {}
    if not c.get("stored"):
        return ""
    line = (
        f"shared chunks: {c['stored']} ({human_bytes(c['stored_bytes'])}), "
        f"{c['unreferenced']} referenced by no snapshot ({human_bytes(c['unreferenced_bytes'])})"
    )
    if c["unreferenced"]:
        verb = "deleted" if result["delete"] else "collectable"
        line += f"; {c['collected']} {verb} ({human_bytes(c['collected_bytes'])})"
        if c["kept"]:
            line += f", {c['kept']} kept: {c['reason']}"
        if c["failed"]:
            line += f", {c['failed']} failed (run gc again)"
    return line


def _checkpoints_lines(result: Msg) -> str:
    """The application-checkpoint namespace's abandoned parts and chunks, when it has any."""
    ck = result.get("checkpoints") or {}
    s = ck.get("summary") or {}
    lines = []
    if s.get("orphans"):
        verb = "deleted" if result["delete"] else "collectable"
        lines.append(f"checkpoints: {s['orphans']} abandoned part(s) of saves that never "
                     f"committed, {s['collected']} {verb}, {s['kept']} kept"
                     + (f", {s['failed']} failed" if s.get("failed") else ""))  # fmt: skip
    chunks = _chunks_line({**ck, "delete": result["delete"]}) if ck else ""
    if chunks:
        lines.append("checkpoints: " + chunks.replace("by no snapshot", "by no checkpoint"))
    return "".join(line + "\n" for line in lines)


def _action(action: str, delete: bool) -> str:
    return "would delete" if action == "collectable" and not delete else action


def _summary_line(result: Msg) -> str:
    s = result["summary"]
    where = result["store"]
    if not s["orphans"]:
        return f"no orphaned snapshots in {where}"
    head = (
        f"{s['orphans']} orphaned snapshot(s) in {where}: {s['objects']} object(s), "
        f"{human_bytes(s['bytes'])}; "
    )
    n, size, kept = s["collected"], human_bytes(s["collected_bytes"]), s["kept"]
    if not result["delete"]:
        tail = f"{n} collectable ({size}), {kept} kept"
        if n:
            tail += "; run `snapshotter gc --delete` to delete them"
        return head + tail
    tail = f"{n} deleted ({size} freed), {kept} kept"
    if s["failed"]:
        tail += f", {s['failed']} failed ({s['failed_keys']} object(s) left)"
    return head + tail


def human_age(seconds: float) -> str:
    """A coarse duration: 45s, 12m, 3h05m, 2d04h (negative ages from clock skew show as 0s)."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
