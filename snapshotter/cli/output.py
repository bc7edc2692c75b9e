"""How the CLI talks to people and scripts: progress on stderr, results on stdout.

The id a command produces (snapshot id, job id) is always the LAST line of stdout, so scripts
can use `$(snapshotter freeze JOB | tail -n1)`; with --json, stdout is one JSON document.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

# Plain JSON data: what --json prints (rpc/convert.py makes it from typed messages).
Msg = dict[str, Any]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class ProgressLine:
    """Renders operation events ({"event": phase|progress, ...}) as one line per phase and
    throttled byte-progress lines; with --json, each event as one JSON line."""

    def __init__(self, as_json: bool, out: TextIO = sys.stderr) -> None:
        self.as_json = as_json
        self.out = out
        self.t0 = time.monotonic()
        self._last_line = 0.0
        self._phase = ""

    def event(self, ev: Msg) -> None:
        if self.as_json:
            self.out.write(json.dumps(ev) + "\n")
            self.out.flush()
            return
        kind = ev.get("event")
        el = time.monotonic() - self.t0
        if kind == "phase":
            self._phase = ev["phase"]
            extra = ""
            if ev.get("stall_s") is not None:
                extra = f" (job stalled {ev['stall_s']:.2f}s)"
            elif ev.get("bytes"):
                extra = f" ({human_bytes(ev['bytes'])} of images)"
            node = f" [{ev['node']}]" if ev.get("node") else ""
            self.out.write(f"[{el:6.1f}s] {self._phase}{node}{extra}\n")
        elif kind == "progress":
            now = time.monotonic()
            if now - self._last_line < 1.0:
                return
            self._last_line = now
            raw = float(ev.get("raw_bytes", 0))
            stored = float(ev.get("stored_bytes", 0))
            rate = raw / max(now - self.t0, 1e-6)
            self.out.write(
                f"[{el:6.1f}s] {self._phase} [{ev.get('node', '')}] {human_bytes(raw)} read, "
                f"{human_bytes(stored)} stored, {human_bytes(rate)}/s\n"
            )
        self.out.flush()


def emit_result(result: Msg, as_json: bool, last_line: str | None, text: str = "") -> None:
    if as_json:
        sys.stdout.write(json.dumps(result, indent=None, default=str) + "\n")
    else:
        if text:
            sys.stdout.write(text.rstrip("\n") + "\n")
        if last_line is not None:
            sys.stdout.write(last_line + "\n")
    sys.stdout.flush()


def table(rows: list[list[str]], header: list[str]) -> str:
    cols = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cols
    ]
    return "\n".join(lines)
