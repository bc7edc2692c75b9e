"""A foreground `snapshotter run` told to go (SIGTERM or another --preempt-signal: a
scheduler's preemption notice, a Slurm --signal, a Kubernetes preStop): the job is frozen and
stopped within the grace period, or, if that fails, stopped behind its newest committed
snapshot. Either way the message says which snapshot the job resumes from.

Ctrl-C (SIGINT) is not a preemption: it stops the job, as torchrun does; a second Ctrl-C
stops waiting for its ranks to end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

from snapshotter import errors
from snapshotter.cli.output import emit_result
from snapshotter.rpc.client import Client
from snapshotter.v1 import common_pb2, coordinator_pb2

pb = coordinator_pb2


# What may be named with --preempt-signal: the notices schedulers send (Slurm's --signal,
# a Kubernetes or systemd stop). SIGINT is Ctrl-C, which stops the job instead.
PREEMPT_SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2,
                   "HUP": signal.SIGHUP}  # fmt: skip


def signal_names(names: list[str] | None) -> list[signal.Signals]:
    """--preempt-signal values (TERM, SIGUSR1, usr1 ...) as signals; SIGTERM by default."""
    out = []
    for n in names or ["TERM"]:
        key = n.upper().removeprefix("SIG")
        if key not in PREEMPT_SIGNALS:
            raise errors.InvalidArgument(
                f"--preempt-signal {n!r} is not a preemption notice snapshotter takes",
                f"one of {', '.join(PREEMPT_SIGNALS)} (Ctrl-C, SIGINT, stops the job instead)",
            )
        out.append(PREEMPT_SIGNALS[key])
    return out


class Notices:
    """What a foreground `run` was told while it streamed the job's output: `stop` is set by a
    preemption notice or by Ctrl-C; `preempted` says which; `interrupts` counts Ctrl-Cs."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.preempted = False
        self.interrupts = 0
        self.again = threading.Event()  # a second Ctrl-C: stop waiting for the job

    def on_notice(self, signum: int, frame: FrameType | None) -> None:
        self.preempted = True
        self.stop.set()

    def on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += 1
        if self.interrupts > 1:
            self.again.set()
        self.stop.set()


@contextlib.contextmanager
def notices(preempt_on: list[signal.Signals]) -> Iterator[Notices]:
    """Notices set by the preemption signals and by SIGINT while the block runs (the previous
    handlers come back after)."""
    n = Notices()
    old = {s: signal.signal(s, n.on_notice) for s in preempt_on}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, n.on_interrupt)
    try:
        yield n
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def newest_snapshot(c: Client, job: str) -> str:
    """The job's newest committed snapshot, or ""."""
    listed = c.stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=job), timeout=60).snapshots
    return max(listed, key=lambda s: (s.created, s.snapshot_id)).snapshot_id if listed else ""


def preempt(c: Client, job: str, grace_s: float, as_json: bool) -> int:
    print(f"preemption notice: freezing job {job} (grace {grace_s:.0f}s)", file=sys.stderr)
    req = pb.FreezeRequest(job_id=job, stop=True, quiesce_timeout_s=max(grace_s / 2, 1.0))
    snap = ""
    why = ""
    try:
        for ev in c.stub.Freeze(req, timeout=grace_s):
            if ev.HasField("done"):
                snap = ev.done.snapshot_id
    except errors.SnapshotterError as e:
        why = str(e)
    if snap:
        emit_result({"job_id": job, "snapshot_id": snap, "fallback": False}, as_json, snap,
                    f"preempted: job {job} frozen and stopped as {snap}; resume it with "
                    f"`snapshotter thaw {snap}`")  # fmt: skip
        return 0
    # The freeze did not make it: the job must not outlive the notice half-done.
    with contextlib.suppress(errors.SnapshotterError):
        c.stub.Cancel(common_pb2.JobRef(job_id=job), timeout=60)
    newest = newest_snapshot(c, job)
    fallback = (f"falling back to its newest committed snapshot {newest}" if newest
                else "it has no committed snapshot")  # fmt: skip
    emit_result({"job_id": job, "snapshot_id": newest, "fallback": True, "error": why}, as_json,
                newest or None,
                f"preempted: the freeze of job {job} failed ({why or 'grace period over'}); "
                f"the job was stopped, {fallback}")  # fmt: skip
    return 128 + signal.SIGTERM
