"""What the coordinator remembers of a job across its thaws and recoveries: the events it
reports, its policy's state, its progress and its recoveries. A `JobRecord` is replaced by
every thaw; its `JobLife` is handed on to the next record under the same job id.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from snapshotter import metrics
from snapshotter.coordinator.detect import Progress
from snapshotter.coordinator.policy import PolicyState
from snapshotter.v1 import coordinator_pb2

pb = coordinator_pb2
KEEP_EVENTS = 500
STATUS_EVENTS = 10


@dataclass
class JobLife:
    events: deque[pb.JobEvent] = field(default_factory=lambda: deque(maxlen=KEEP_EVENTS))
    policy_state: PolicyState = field(default_factory=PolicyState)
    progress: Progress = field(default_factory=Progress)
    # Wall times of the automatic recoveries (the crash-loop limit counts them).
    recoveries: list[float] = field(default_factory=list)
    # Why automatic recovery stopped: the job is then FAILED for good.
    gave_up: str = ""
    # A failure was seen and a recovery will run or runs: the job reports RECOVERING.
    recovering: bool = False
    # The user cancelled it: never recovered.
    cancelled: bool = False
    # Measured stalls of this job's freezes (seconds, newest last): the `auto` cost.
    stalls: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    # Optimizer steps of the job when each of its snapshots was taken (steps lost on recovery).
    snapshot_steps: dict[str, int] = field(default_factory=dict)
    # The last traceback of the rank that failed (what a give-up reports).
    last_traceback: str = ""
    # No data-link plane works on all its nodes, and that was reported (coordinator/reroute.py).
    links_down: bool = False
    links_down_since: float | None = None  # when no plane worked on all its nodes any more
    # When a collective stuck past the link deadline last made us try another plane.
    link_suspected_at: float | None = None
    # The background thread working on this job (a policy freeze or a recovery), if any.
    worker: threading.Thread | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Counts the events added: what journal.py keeps in the store is rewritten when it moves
    # (every change worth keeping comes with an event).
    changes: int = 0
    # Where each new event goes besides (the coordinator's webhooks; never persisted).
    sink: Callable[[pb.JobEvent], None] | None = None

    def add(self, kind: str, **kw: object) -> pb.JobEvent:
        ev = pb.JobEvent(time=time.time(), kind=kind, **kw)  # type: ignore[arg-type]
        with self.lock:
            self.events.append(ev)
            self.changes += 1
        metrics.JOB_EVENTS.labels(kind).inc()
        if self.sink is not None:
            self.sink(ev)
        return ev

    def newest(self, n: int = STATUS_EVENTS) -> list[pb.JobEvent]:
        with self.lock:
            return list(self.events)[-n:]

    def busy(self) -> bool:
        w = self.worker
        return w is not None and w.is_alive()
