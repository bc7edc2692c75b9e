"""What the coordinator remembers of a job, kept in the store beside the snapshots, so that a
restarted coordinator (or its replacement on another machine) goes on with the job's history:
its events, the times of its automatic recoveries (the crash-loop limit counts them), why
recovery gave up, the measured stalls of its freezes (the `auto` interval's cost) and the steps
at each snapshot.

One object per job, `jobs/<job id>/life.json`, rewritten when the job's life changed (the
supervisor's tick); read when a job is re-learned from its agents or thawed with no record here.
What is read back comes from the store, so it is checked field by field: a damaged or foreign
object loses the history (with a warning), never the job. Clocks of this process (policy timers,
progress) are not kept: they start again.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

from google.protobuf import json_format

from snapshotter import errors
from snapshotter.coordinator.life import JobLife
from snapshotter.rpc import convert
from snapshotter.storage.api import ObjectMissing, ObjectStore
from snapshotter.v1 import coordinator_pb2

log = logging.getLogger(__name__)
FORMAT = 1


def key_of(job_id: str) -> str:
    return f"jobs/{job_id}/life.json"


def dump(job_id: str, life: JobLife) -> bytes:
    with life.lock:
        events = [convert.plain(e) for e in life.events]
    doc = {
        "format": FORMAT,
        "job_id": job_id,
        "events": events,
        "recoveries": list(life.recoveries),
        "gave_up": life.gave_up,
        "cancelled": life.cancelled,
        "stalls": list(life.stalls),
        "snapshot_steps": dict(life.snapshot_steps),
        "last_traceback": life.last_traceback,
    }
    return json.dumps(doc).encode()


def load(job_id: str, data: bytes) -> JobLife:
    """The life `dump` wrote for `job_id`.

    Raises:
        ValueError: not such an object (damaged, another job's, a newer format).
    """
    doc = json.loads(data)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("job_id") != job_id:
        raise ValueError(f"not a format-{FORMAT} life of job {job_id}")
    life = JobLife()
    for e in _list(doc, "events", dict):
        try:
            life.events.append(convert.parse(e, coordinator_pb2.JobEvent))
        except (json_format.ParseError, TypeError, ValueError) as err:
            raise ValueError(f"a bad event: {err}") from err
    life.recoveries = [float(t) for t in _list(doc, "recoveries", (int, float)) if _finite(t)]
    life.stalls.extend(float(s) for s in _list(doc, "stalls", (int, float)) if _finite(s))
    life.gave_up = _str(doc, "gave_up")
    life.last_traceback = _str(doc, "last_traceback")
    life.cancelled = doc.get("cancelled") is True
    steps = doc.get("snapshot_steps", {})
    if not isinstance(steps, dict):
        raise ValueError("snapshot_steps is not an object")
    life.snapshot_steps = {str(k): int(v) for k, v in steps.items()
                           if isinstance(v, int) and not isinstance(v, bool)}  # fmt: skip
    return life


def _list(doc: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> list[Any]:
    v = doc.get(name, [])
    if not isinstance(v, list) or not all(isinstance(x, kind) for x in v):
        raise ValueError(f"{name} is not a list of {kind}")
    return v


def _str(doc: dict[str, Any], name: str) -> str:
    v = doc.get(name, "")
    if not isinstance(v, str):
        raise ValueError(f"{name} is not a string")
    return v


def _finite(x: Any) -> bool:
    return not isinstance(x, bool) and math.isfinite(x)


class Journal:
    """Writes each job's life to the store when it changed, reads it back on demand."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._written: dict[str, int] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()

    def save_changed(self, lives: Iterable[tuple[str, JobLife]]) -> None:
        # One writer at a time (the tick and an operator's change): an older life must not
        # land after a newer one.
        with self._write_lock:
            for job_id, life in lives:
                changes = life.changes
                with self._lock:
                    if self._written.get(job_id, 0) == changes:  # (no events: nothing)
                        continue
                try:
                    self.store.put_bytes(key_of(job_id), dump(job_id, life))
                except errors.SnapshotterError as e:
                    log.warning("job %s: its events are not kept in the store now: %s", job_id, e)
                    continue
                with self._lock:
                    self._written[job_id] = changes

    def read(self, job_id: str) -> JobLife | None:
        """The job's life as last written, or None (none written, or unreadable)."""
        try:
            data = self.store.get_bytes(key_of(job_id))
        except ObjectMissing:
            return None
        except errors.SnapshotterError as e:
            log.warning("job %s: its history could not be read (%s)", job_id, e)
            return None
        try:
            life = load(job_id, data)
        except ValueError as e:
            log.warning("job %s: its history in the store is unusable (%s); starting afresh",
                        job_id, e)  # fmt: skip
            return None
        with self._lock:
            self._written[job_id] = life.changes
        return life

    def forget(self, job_ids: Iterable[str]) -> None:
        ids = list(job_ids)
        with self._lock:
            for j in ids:
                self._written.pop(j, None)
        try:
            self.store.delete_keys([key_of(j) for j in ids])
        except errors.SnapshotterError as e:
            log.warning("could not delete the history of job(s) %s: %s", ", ".join(ids), e)
