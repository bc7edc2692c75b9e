"""What a freeze, thaw or migration shows while it runs, on stderr.

- On a terminal: `rich` bars, one per node and a total (bytes, percent, the rate over the last
  seconds, time left), with each phase printed above them as it starts.
- Not on a terminal (a log, a pipe, TERM=dumb): a line per phase and at most one progress line
  a second (bytes, percent, recent rate, time left).
- With --json: every event as one JSON line, as it comes.

Events are the plain form of the rpc streams' PhaseEvent and TransferProgress
({"event": "phase"|"progress", ...}); `total_bytes` 0 means the total is not known yet.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from snapshotter.cli.output import Msg, human_bytes

RATE_WINDOW_S = 5.0  # the rate shown is over this many seconds, not since the command started


class RecentRate:
    """Bytes per second over the last `window` seconds of (time, cumulative bytes) samples."""

    def __init__(self, window: float = RATE_WINDOW_S) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, done: float) -> float:
        self._samples.append((t, done))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self.window:
            self._samples.popleft()
        t0, d0 = self._samples[0]
        return (done - d0) / (t - t0) if t > t0 else 0.0


def eta_s(done: float, total: float, rate: float) -> float | None:
    """Seconds left at `rate`, or None when that cannot be said."""
    if total <= 0:
        return None
    if done >= total:
        return 0.0
    return (total - done) / rate if rate > 0 else None


def _phase_text(ev: Msg, elapsed: float) -> str:
    extra = ""
    if ev.get("stall_s") is not None:
        extra = f" (job stalled {ev['stall_s']:.2f}s)"
    elif ev.get("bytes"):
        extra = f" ({human_bytes(ev['bytes'])} of images)"
    node = f" [{ev['node']}]" if ev.get("node") else ""
    return f"[{elapsed:6.1f}s] {ev['phase']}{node}{extra}"


class View(Protocol):
    def event(self, ev: Msg) -> None: ...

    def close(self) -> None: ...


class JsonLines:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def event(self, ev: Msg) -> None:
        self.out.write(json.dumps(ev) + "\n")
        self.out.flush()

    def close(self) -> None:
        pass


class PlainLines:
    """A line per phase; progress at most once a second per node."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.out = out
        self.clock = clock
        self.t0 = clock()
        self._phase = ""
        self._last: dict[str, float] = {}
        self._rates: dict[str, RecentRate] = {}
        self._finished: set[str] = set()

    def event(self, ev: Msg) -> None:
        now = self.clock()
        if ev.get("event") == "phase":
            self._phase = ev["phase"]
            self.out.write(_phase_text(ev, now - self.t0) + "\n")
        elif ev.get("event") == "progress":
            node = str(ev.get("node", ""))
            done, total = float(ev.get("raw_bytes", 0)), float(ev.get("total_bytes", 0))
            rate = self._rates.setdefault(node, RecentRate()).add(now, done)
            finished = bool(total) and done >= total
            if node in self._finished or (now - self._last.get(node, -1e9) < 1.0
                                          and not finished):  # fmt: skip
                return
            self._last[node] = now
            if finished:
                self._finished.add(node)
            parts = [human_bytes(done) + (f" {100 * done / total:3.0f}% of {human_bytes(total)}"
                                          if total else "")]  # fmt: skip
            if rate > 0:
                parts.append(f"{human_bytes(rate)}/s")
            left = eta_s(done, total, rate)
            if left is not None:
                parts.append(f"{left:.0f}s left")
            self.out.write(
                f"[{now - self.t0:6.1f}s] {self._phase} [{node}] {', '.join(parts)}\n"
            )
        self.out.flush()

    def close(self) -> None:
        pass


class Bars:
    """rich bars: one per node that reports progress, and a total of them."""

    def __init__(
        self, console: Console, clock: Callable[[], float] = time.monotonic, auto: bool = True
    ) -> None:
        self.clock = clock
        self.t0 = clock()
        self.progress = Progress(
            TextColumn("{task.description:<18}"),
            BarColumn(bar_width=30),
            TaskProgressColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            get_time=clock,
            auto_refresh=auto,
            speed_estimate_period=RATE_WINDOW_S,
            transient=False,
        )
        self._nodes: dict[str, TaskID] = {}
        self._done: dict[str, tuple[float, float]] = {}
        self._total: TaskID | None = None
        self._phase = ""
        self.progress.start()

    def event(self, ev: Msg) -> None:
        if ev.get("event") == "phase":
            self._phase = ev["phase"]
            self.progress.console.print(
                _phase_text(ev, self.clock() - self.t0), highlight=False, markup=False
            )
        elif ev.get("event") == "progress":
            node = str(ev.get("node", "")) or "node"
            done, total = float(ev.get("raw_bytes", 0)), float(ev.get("total_bytes", 0))
            if node not in self._nodes:
                self._nodes[node] = self.progress.add_task(
                    f"{self._phase} {node}", total=total or None
                )
            self.progress.update(self._nodes[node], completed=done, total=total or None)
            self._done[node] = (done, total)
            self._update_total()
        if not self.progress.live.auto_refresh:
            self.progress.refresh()

    def _update_total(self) -> None:
        if len(self._nodes) < 2:
            return  # one node: its bar is the total
        done = sum(d for d, _ in self._done.values())
        totals = [t for _, t in self._done.values()]
        total = sum(totals) if all(totals) else None
        if self._total is None:
            self._total = self.progress.add_task("total", total=total)
        self.progress.update(self._total, completed=done, total=total)

    def close(self) -> None:
        self.progress.stop()


def view(as_json: bool, out: TextIO | None = None) -> View:
    """The progress view for this command's stderr."""
    out = out or sys.stderr
    if as_json:
        return JsonLines(out)
    if out.isatty() and os.environ.get("TERM", "") not in ("", "dumb"):
        return Bars(Console(file=out, stderr=out is sys.stderr))
    return PlainLines(out)


def drive(stream: Any, v: View, to_msg: Callable[[Any], Msg]) -> Msg | None:
    """Show each event of `stream`; the `done` event's message (None if the stream had none).
    The bars are closed however the stream ends."""
    result: Msg | None = None
    try:
        for raw in stream:
            ev = to_msg(raw)
            if ev["event"] == "done":
                result = ev
            else:
                v.event(ev)
    finally:
        v.close()
    return result
