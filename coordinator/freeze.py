"""A whole-job freeze, driven across every node agent in phases.

    prepare  every rank reports its collective counts   (failure: nothing to undo but the lock)
    park     every rank stops before the chosen target  (not all parked by the deadline: abort)
    suspend  every rank closes its sockets              (failure: resume)
    dump     CRIU dumps every rank, ranks left running  (failure: resume)
    resume   (freeze-and-continue) ranks rebuild their communicators and go on
    upload   every node streams its images to storage in parallel (failure: discard chunks)
    commit   the manifest is written last, after every chunk was checked
    stop     (--stop) ranks end only after the commit   (failure before: resume)

Whatever fails, the job is either running as before or cleanly stopped behind a committed
snapshot, and no manifest exists for an incomplete snapshot.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coordinator.agents import AgentHandle, merge_streams, on_all
from coordinator.decisions import pick_targets, snapshot_id
from snapshotter import errors
from snapshotter.launch.spec import JobSpec
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.transfer import commit_snapshot

log = logging.getLogger(__name__)
Msg = dict[str, Any]


@dataclass(frozen=True)
class FreezeSettings:
    prepare_timeout: float = 30.0
    quiesce_timeout: float = 60.0
    suspend_timeout: float = 60.0
    resume_timeout: float = 120.0
    keepalive_s: float = 5.0


def _first(failures: dict[str, BaseException]) -> BaseException:
    return next(iter(failures.values()))


def lost_text(silent: list[str], ended: list[str]) -> str:
    parts = []
    if silent:
        parts.append(f"node(s) {', '.join(silent)} do not answer")
    if ended:
        parts.append(f"the ranks on node(s) {', '.join(ended)} ended")
    return "; ".join(parts)


class FreezeOperation:
    def __init__(
        self,
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        store: ObjectStore,
        stop: bool,
        settings: FreezeSettings,
        on_committed: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self.agents = list(agents)
        self.store = store
        self.stop = stop
        self.settings = settings
        self.freeze_id = f"frz-{secrets.token_hex(6)}"
        self.snapshot_id = snapshot_id(spec.job_id, datetime.now(UTC), secrets.token_hex(2))
        self._on_committed = on_committed
        self._prepared: list[AgentHandle] = []
        self._suspended = False
        self._resumed = False
        self._uploaded = False

    def _req(self, **kw: Any) -> Msg:
        return {"job_id": self.spec.job_id, "freeze_id": self.freeze_id, **kw}

    def run(self) -> Iterator[Msg]:
        done = threading.Event()
        keeper = threading.Thread(target=self._keep_alive, args=(done,), daemon=True)
        keeper.start()
        try:
            yield from self._run()
        except BaseException as e:
            lost = self._recover(e)
            if lost:
                raise errors.FreezeFailed(
                    f"{e.cause if isinstance(e, errors.SnapshotterError) else e}; the job "
                    f"cannot go on ({lost}), so it was stopped on every node",
                    "thaw its latest snapshot (`snapshotter list --job "
                    f"{self.spec.job_id}`) onto healthy nodes with --nodes",
                ) from e
            raise
        finally:
            done.set()

    def _keep_alive(self, done: threading.Event) -> None:
        """Renew every agent's lease on this freeze while it runs: a node that is quick in a
        phase must not give up while a slower one still works (agent/node.py: leases)."""
        while not done.wait(self.settings.keepalive_s):
            on_all(self.agents, lambda a: a.call("KeepFreeze", self._req(), timeout=5))

    def _run(self) -> Iterator[Msg]:
        s = self.settings
        t_start = time.monotonic()
        yield {"event": "phase", "phase": "prepare", "snapshot_id": self.snapshot_id}
        # Refuse before touching the ranks when the snapshot could not be stored anyway.
        next(iter(self.store.list_keys("snapshots/")), None)
        res, fail = on_all(
            self.agents,
            lambda a: a.call(
                "Prepare", self._req(timeout=s.prepare_timeout), timeout=s.prepare_timeout + 10
            ),
        )
        self._prepared = [a for a in self.agents if a.name in res]
        if fail:
            raise _first(fail)
        counts: dict[int, dict[str, int]] = {}
        for r in res.values():
            counts.update({int(k): v for k, v in r["counts"].items()})
        targets = pick_targets(counts)

        yield {"event": "phase", "phase": "quiesce", "targets": targets}
        t_park = time.monotonic()
        res, fail = on_all(
            self.agents,
            lambda a: a.call(
                "Park",
                self._req(targets=targets, timeout=s.quiesce_timeout),
                timeout=s.quiesce_timeout + 10,
            ),
        )
        if fail:
            raise _first(fail)
        missing = {rank: why for r in res.values() for rank, why in r["missing"].items()}
        if missing:
            who = ", ".join(sorted(missing, key=int))
            detail = "; ".join(missing[k] for k in sorted(missing, key=int))
            raise errors.QuiesceTimeout(
                f"rank(s) {who} did not reach collective barrier {targets} within "
                f"{s.quiesce_timeout:.0f}s ({detail})",
                "the job was left running as before; retry when the job is in its training "
                "loop, or raise --quiesce-timeout",
            )
        quiesce_s = time.monotonic() - t_park

        yield {"event": "phase", "phase": "suspend"}
        self._suspended = True
        _, fail = on_all(
            self.agents,
            lambda a: a.call(
                "Suspend", self._req(timeout=s.suspend_timeout), timeout=s.suspend_timeout + 10
            ),
        )
        if fail:
            raise _first(fail)

        yield {"event": "phase", "phase": "dump"}
        t_dump = time.monotonic()
        dumps, fail = on_all(self.agents, lambda a: a.call("Dump", self._req(), timeout=None))
        if fail:
            raise _first(fail)
        dump_s = time.monotonic() - t_dump
        image_bytes = sum(r["image_bytes"] for d in dumps.values() for r in d["ranks"])

        stall_s = None
        if not self.stop:
            self._resume()
            stall_s = time.monotonic() - t_park
            yield {"event": "phase", "phase": "resumed", "stall_s": stall_s}

        yield {"event": "phase", "phase": "upload", "bytes": image_bytes}
        t_up = time.monotonic()
        streams: dict[str, Msg] = {}
        ranks: list[Msg] = []
        uploads: list[Msg] = []
        failures: dict[str, BaseException] = {}
        self._uploaded = True  # from here on, chunks may exist that a failure must remove
        for name, ev in merge_streams(
            self.agents, "Upload", lambda a: self._req(snapshot_id=self.snapshot_id)
        ):
            if isinstance(ev, BaseException):
                failures[name] = ev
            elif ev.get("event") == "progress":
                yield {**ev, "node": name}
            elif ev.get("event") == "uploaded":
                streams.update(ev["streams"])
                ranks.extend(ev["ranks"])
                uploads.append(ev["upload"])
        if failures:
            raise _first(failures)
        upload_s = time.monotonic() - t_up

        yield {"event": "phase", "phase": "commit"}
        stats: Msg = {
            "quiesce_s": quiesce_s,
            "dump_s": dump_s,
            "upload_s": upload_s,
            "stall_s": stall_s,
            "image_bytes": image_bytes,
            "uploads": uploads,
        }
        meta = {
            "job": self.spec.to_dict(),
            "source_job": self.spec.job_id,
            "freeze_id": self.freeze_id,
            "targets": targets,
            "ranks": sorted(ranks, key=lambda r: int(r["rank"])),
            "nodes": [a.name for a in self.agents],
            "stats": stats,
        }
        commit_snapshot(self.store, self.snapshot_id, streams, meta)
        self._on_committed(self.snapshot_id)

        if self.stop:
            yield {"event": "phase", "phase": "stop"}
        on_all(self.agents, lambda a: a.call("FinishFreeze", self._req(stop=self.stop), timeout=60))
        yield {
            "event": "done",
            "snapshot_id": self.snapshot_id,
            "stopped": self.stop,
            "stats": {**stats, "total_s": time.monotonic() - t_start},
        }

    def _resume(self) -> None:
        s = self.settings
        _, fail = on_all(
            self.agents,
            lambda a: a.call(
                "Resume", self._req(timeout=s.resume_timeout), timeout=s.resume_timeout + 10
            ),
        )
        self._resumed = True
        if fail:
            raise errors.FreezeFailed(
                f"ranks could not rebuild their communicators after the dump: {_first(fail)}",
                "the job is likely stuck; cancel it and thaw the last snapshot",
            ) from _first(fail)

    def _recover(self, cause: BaseException) -> str:
        """Put the job back as it was: unpark, or resume after a suspend; drop partial data.
        When a node is gone (its agent does not answer, or its ranks died) the job cannot go
        on: it is stopped everywhere, and the nodes lost are returned."""
        log.warning(
            "freeze %s of %s failed: %s; recovering", self.freeze_id, self.spec.job_id, cause
        )
        silent, ended = self._lost_nodes()
        if silent or ended:
            if self._uploaded:
                on_all(self.agents, lambda a: a.call("DiscardUpload", self._req(), timeout=30))
            on_all(
                [a for a in self.agents if a.name not in silent],
                lambda a: a.call("Cancel", {"job_id": self.spec.job_id}, timeout=60),
            )
            return lost_text(silent, ended)
        self._restore_job()
        return ""

    def _lost_nodes(self) -> tuple[list[str], list[str]]:
        """Nodes whose agent does not answer, and nodes whose ranks have ended."""
        res, fail = on_all(
            self.agents, lambda a: a.call("Status", {"job_id": self.spec.job_id}, timeout=10)
        )
        ended = [n for n, st in res.items() if st["state"] in ("FAILED", "CANCELLED")]
        return sorted(fail), sorted(ended)

    def _restore_job(self) -> None:
        if self._uploaded:
            on_all(self.agents, lambda a: a.call("DiscardUpload", self._req(), timeout=120))
        if self._suspended and not self._resumed:
            try:
                self._resume()
            except errors.SnapshotterError as e:
                log.error("resume after failed freeze failed: %s", e)
        elif self._prepared and not self._suspended:
            on_all(self._prepared, lambda a: a.call("Abort", self._req(), timeout=60))
            return  # Abort released the agents' freeze state
        on_all(self._prepared, lambda a: a.call("FinishFreeze", self._req(stop=False), timeout=60))
