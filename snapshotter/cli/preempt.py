"""A foreground `snapshotter run` told to go (SIGTERM: a scheduler's preemption notice, a
Slurm --signal, a Kubernetes preStop): the job is frozen and stopped within the grace
period, or, if that fails, stopped behind its newest committed snapshot. Either way the
message says which snapshot the job resumes from.
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


@contextlib.contextmanager
def on_sigterm() -> Iterator[threading.Event]:
    """An event set by SIGTERM while the block runs (the previous handler comes back after)."""
    notice = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        notice.set()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield notice
    finally:
        signal.signal(signal.SIGTERM, old)


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
    listed = c.stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=job), timeout=60).snapshots
    newest = max(listed, key=lambda s: (s.created, s.snapshot_id)).snapshot_id if listed else ""
    fallback = (f"falling back to its newest committed snapshot {newest}" if newest
                else "it has no committed snapshot")  # fmt: skip
    emit_result({"job_id": job, "snapshot_id": newest, "fallback": True, "error": why}, as_json,
                newest or None,
                f"preempted: the freeze of job {job} failed ({why or 'grace period over'}); "
                f"the job was stopped, {fallback}")  # fmt: skip
    return 128 + signal.SIGTERM
