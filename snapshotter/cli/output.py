"""How the CLI talks to people and scripts: progress on stderr, results on stdout.

The id a command produces (snapshot id, job id) is always the LAST line of stdout, so scripts
can use `$(snapshotter freeze JOB | tail -n1)`; with --json, stdout is one JSON document.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# Plain JSON data: what --json prints (rpc/convert.py makes it from typed messages).
Msg = dict[str, Any]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


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
