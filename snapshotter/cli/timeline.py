"""Where a freeze's time went, drawn from its spans (coordinator/freeze.py records them):
`snapshotter show SNAP --timeline` as text, `--trace FILE` as a Chrome trace.

Rows, in both: the coordinator's own (the commit) first, then each node, each followed by its
ranks. A node's phases are the coordinator's calls to its agent as the coordinator timed them,
its upload and its ranks' dumps as the agent timed them (each on its own clock: a skew between
machines shows as a shift). The Chrome trace is the JSON Trace Event Format (`"X"` complete
events, `"M"` metadata naming processes and threads), which chrome://tracing and
https://ui.perfetto.dev open: one process per row group (coordinator, node), one thread per
row (tid 0 the node itself, tid rank + 1 each rank).

Pure functions: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any, Protocol

# The phases a freeze records, in their order, with the letter that draws each.
LETTERS = {
    "prepare": "P",
    "park": "K",
    "suspend": "S",
    "dump": "D",
    "resume": "R",
    "upload": "U",
    "commit": "C",
    "finish": "F",
}
COORDINATOR = "coordinator"  # the row of the spans whose node is ""
LABEL_MAX = 24


class Span(Protocol):
    """What a span is read as (a snapshotter.v1.Span, or anything alike)."""

    @property
    def node(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def phase(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _rows(spans: Sequence[Span]) -> list[tuple[str, int]]:
    """(node, rank) of every row in order: the coordinator, then each node and its ranks."""
    nodes = sorted({s.node for s in spans}, key=lambda n: (n != "", _natural(n)))
    ranks = {n: sorted({s.rank for s in spans if s.node == n and s.rank >= 0}) for n in nodes}
    return [row for n in nodes for row in [(n, -1), *((n, r) for r in ranks[n])]]


def _letters(spans: Sequence[Span]) -> dict[str, str]:
    """Every phase's letter: the known ones', then a free one for any other (a newer writer's)."""
    out = {p: c for p, c in LETTERS.items() if any(s.phase == p for s in spans)}
    for phase in sorted({s.phase for s in spans} - set(LETTERS)):
        taken = set(LETTERS.values()) | set(out.values())
        free = [c for c in phase.upper() + "ABCDEFGHIJLMNOQTVWXYZ0123456789" if c.isalnum()]
        out[phase] = next((c for c in free if c not in taken), "?")
    return out


def _label(node: str, rank: int) -> str:
    text = f"  rank {rank}" if rank >= 0 else node or COORDINATOR
    return text if len(text) <= LABEL_MAX else text[: LABEL_MAX - 1] + "~"


def _seconds(s: float) -> str:
    return f"{s:.3f}s" if s < 10 else f"{s:.1f}s"


def timeline_text(spans: Sequence[Span], width: int = 100) -> str:
    """An ASCII Gantt chart `width` columns wide: a scale, one row per node and per rank
    (its phases' letters; each span takes one column at least, and a shorter one is drawn
    over a longer one, so that every span shows), and a legend with each phase's letter and
    its duration from its first start to its last end over all nodes.

    Raises:
        ValueError: no spans, or a width too narrow to draw in.
    """
    if not spans:
        raise ValueError("no spans to draw")
    rows = _rows(spans)
    label_w = max(len(_label(n, r)) for n, r in rows) + 1
    bar = width - label_w - 2  # between the two "|"
    if bar < 10:
        raise ValueError(f"width {width} leaves {bar} columns for the chart (10 at least)")
    t0 = min(s.start for s in spans)
    total = max(max(s.end for s in spans) - t0, 1e-9)
    letters = _letters(spans)

    def col(t: float) -> float:
        return (t - t0) / total * bar

    lines = [
        f"freeze timeline: {_seconds(total)} in all, one column is {_seconds(total / bar)}",
        " " * (label_w + 1) + "0s".ljust(bar - len(_seconds(total))) + _seconds(total),
    ]
    for node, rank in rows:
        cells = [" "] * bar
        mine = [s for s in spans if s.node == node and (s.rank if s.rank >= 0 else -1) == rank]
        for s in sorted(mine, key=lambda s: (s.start - s.end, s.start)):  # longest first
            c0 = min(int(col(s.start)), bar - 1)
            c1 = max(c0 + 1, min(math.ceil(col(max(s.end, s.start))), bar))
            cells[c0:c1] = letters[s.phase] * (c1 - c0)
        lines.append(_label(node, rank).ljust(label_w) + "|" + "".join(cells) + "|")
    legend = []
    for phase, letter in letters.items():
        of = [s for s in spans if s.phase == phase]
        took = max(s.end for s in of) - min(s.start for s in of)
        legend.append(f"{letter} {phase} {_seconds(max(took, 0.0))}")
    line = ""
    for item in legend:  # as many to a line as fit, never one cut in two
        if line and len(line) + 3 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}   {item}" if line else item
    lines.append(line)
    return "\n".join(lines) + "\n"


def _meta(kind: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def chrome_trace(spans: Sequence[Span]) -> dict[str, Any]:
    """The spans as a Chrome trace (Trace Event Format, JSON object form): an "X" event per
    span, `ts` in microseconds since the first span's start, `pid` the row group (1 the
    coordinator or the first node, in `timeline_text`'s order), `tid` 0 for a node's own
    phases and rank + 1 for a rank's; "M" events name every process and thread."""
    rows = _rows(spans)
    nodes = list(dict.fromkeys(n for n, _ in rows))
    pid = {n: i + 1 for i, n in enumerate(nodes)}
    t0 = min((s.start for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    for n in nodes:
        events.append(_meta("process_name", pid[n], 0, {"name": f"node {n}" if n else COORDINATOR}))
        events.append(_meta("process_sort_index", pid[n], 0, {"sort_index": pid[n]}))
    for n, r in rows:
        tid = r + 1 if r >= 0 else 0
        name = f"rank {r}" if r >= 0 else (n or COORDINATOR)
        events.append(_meta("thread_name", pid[n], tid, {"name": name}))
        events.append(_meta("thread_sort_index", pid[n], tid, {"sort_index": tid}))
    for s in sorted(spans, key=lambda s: (s.start, s.node, s.rank)):
        rank = s.rank if s.rank >= 0 else -1
        events.append(
            {
                "name": s.phase,
                "cat": "freeze",
                "ph": "X",
                "ts": round((s.start - t0) * 1e6, 3),
                "dur": round(max(s.end - s.start, 0.0) * 1e6, 3),
                "pid": pid[s.node],
                "tid": rank + 1,
                "args": {
                    "node": s.node or COORDINATOR,
                    "rank": rank,
                    "start": s.start,
                    "end": s.end,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
