"""What a rank's steps and collectives cost, kept in memory for the agent to read.

Two records, both bounded rings written without I/O on the thread that trains:

- step times: when each optimizer step finished (one deque append per step);
- collective latencies per group (and per point-to-point channel): seconds from issue to
  completion of each op. On the native path (csrc/gate/telemetry.h) completion is stamped by
  the op's future on the communicator's thread; on the Python path (NCCL groups, or no native
  build) it is stamped when the rank first sees the op done (its wait returns, or the barrier
  polls it), since a callback there would take the GIL on the communicator's thread.

Each latency is kept with the op's sequence number on its group, the same on every member.
Why latencies name a straggler: a collective completes only once every member issued it, so
the member that issues last waits least and the others wait for it. Lined up by sequence
number, the rank with the lowest latency of most collectives is the one its peers wait for
(coordinator/top_rules.py judges it). `summary` turns the rings into a `progress` reply's.

Only stdlib here: ranks may lack anything else. SNAPSHOTTER_TELEMETRY=0 turns the record off.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from snapshotter.hook.barrier import CHANNEL_MARK

RING = 64  # latencies kept per group: about one step of a DDP job with many buckets, or more
STEPS = 33  # step times kept: 32 durations


def enabled() -> bool:
    return os.environ.get("SNAPSHOTTER_TELEMETRY", "1") != "0"


Entry = tuple[int, float]  # (seq, seconds)


class Latencies:
    """Python-path ops' latencies per key, as the native gate keeps them for its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rings: dict[str, tuple[list[int], deque[Entry]]] = {}

    def record(self, key: str, seq: int, seconds: float) -> None:
        with self._lock:
            ring = self._rings.get(key)
            if ring is None:
                ring = self._rings[key] = ([0], deque(maxlen=RING))
            ring[0][0] += 1
            ring[1].append((seq, seconds))

    def forget(self, key: str) -> None:
        """A destroyed group: its channels go with it."""
        with self._lock:
            for k in [k for k in self._rings if k == key or k.startswith(key + CHANNEL_MARK)]:
                del self._rings[k]

    def snapshot(self) -> dict[str, tuple[int, list[Entry]]]:
        """key -> (ops completed, the latest (seq, seconds), in completion order)."""
        with self._lock:
            return {k: (n[0], list(ring)) for k, (n, ring) in self._rings.items()}


class StepClock:
    """When the latest optimizer steps finished (time.monotonic())."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=STEPS)

    def tick(self) -> None:
        # On the training thread after every step: one append, no lock (deque.append is atomic).
        self._times.append(time.monotonic())

    def durations(self) -> list[float]:
        t = list(self._times)
        return [b - a for a, b in zip(t, t[1:], strict=False)]


def summary(
    step_durations: Sequence[float],
    latencies: Iterable[Mapping[str, tuple[int, Sequence[Entry]]]],
) -> dict[str, Any]:
    """The `telemetry` of a progress reply: the median recent step and, per key, how many ops
    completed, the mean and median of the latest latencies and those latencies by sequence
    number (`recent`: [seq, microseconds] pairs; not for point-to-point channels, whose
    numbers differ between the two ends' views only by direction). `latencies`: one map per
    source (the native gate's, the Python path's); a key in both adds up."""
    merged: dict[str, tuple[int, list[Entry]]] = {}
    for source in latencies:
        for key, (done, recent) in source.items():
            n, vals = merged.get(key, (0, []))
            merged[key] = (n + int(done), vals + [(int(q), float(v)) for q, v in recent])
    groups: dict[str, Any] = {}
    for key, (done, vals) in sorted(merged.items()):
        if not vals:
            continue
        secs = [v for _, v in vals]
        g: dict[str, Any] = {"done": done, "window": len(vals), "mean_s": statistics.fmean(secs),
                             "p50_s": statistics.median(secs)}  # fmt: skip
        if CHANNEL_MARK not in key:
            g["recent"] = [[q, round(v * 1e6)] for q, v in sorted(vals)]
        groups[key] = g
    step_s = statistics.median(step_durations) if step_durations else 0.0
    return {"step_s": step_s, "steps_window": len(step_durations), "groups": groups}
