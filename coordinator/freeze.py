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

Where the time went is kept as spans (`show --timeline`): each phase's call on each node, as
the coordinator timed it, each rank's dump and each node's upload as its agent timed them, and
the commit; the manifest keeps them in its meta as "spans" ([{node, rank, phase, start, end}]).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from snapshotter import errors, parallel
from snapshotter.coordinator.agents import AgentHandle, call_all, on_all, stream_all
from snapshotter.coordinator.decisions import pick_targets, snapshot_id
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import convert
from snapshotter.rpc.aio import LOOP
from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.sealing import Seal
from snapshotter.storage.signing import Signer
from snapshotter.storage.transfer import commit_snapshot
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)
pb = coordinator_pb2
R = TypeVar("R")


@dataclass(frozen=True)
class FreezeSettings:
    prepare_timeout: float = 30.0
    quiesce_timeout: float = 60.0
    suspend_timeout: float = 60.0
    resume_timeout: float = 120.0
    # A node's lease is renewed once it has had no call for half this, checked 4 times as
    # often: renewed within 0.75 x keepalive_s of its last call (an agent's --freeze-lease
    # must be longer; its default is 60 s).
    keepalive_s: float = 5.0
    # How long a node whose agent went silent may take to answer again before it counts as
    # lost: an agent under a keeper is started again within seconds and re-adopts its ranks.
    rejoin_s: float = 10.0


def _first(failures: dict[str, BaseException]) -> BaseException:
    return next(iter(failures.values()))


def lost_text(silent: list[str], ended: list[str]) -> str:
    parts = []
    if silent:
        parts.append(f"node(s) {errors.few(silent)} do not answer")
    if ended:
        parts.append(f"the ranks on node(s) {errors.few(ended)} ended")
    return "; ".join(parts)


def _refuses_at_once(a: AgentHandle, within_s: float = 1.0) -> bool:
    """Whether a call to the agent fails fast (connection refused), not by its deadline."""
    t0 = time.monotonic()
    try:
        a.stub.Ping(common_pb2.Empty(), timeout=within_s * 2)
        return True  # it answers again already
    except errors.SnapshotterError:
        return time.monotonic() - t0 < within_s


def _phase(phase: str, **kw: Any) -> coordinator_pb2.FreezeEvent:
    return pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase=phase, **kw))


class FreezeOperation:
    # How a failure is reported (a migration shares the phases and the recovery).
    what = "freeze"
    failed: type[errors.SnapshotterError] = errors.FreezeFailed
    outcome = "no snapshot was made"

    def __init__(
        self,
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        store: ObjectStore,
        stop: bool,
        settings: FreezeSettings,
        on_committed: Callable[[str], None],
        current: Callable[[str], AgentHandle | None] | None = None,
        signer: Signer | None = None,
        seal: Seal | None = None,
    ) -> None:
        """`current(name)`: the coordinator's handle on a node's agent now (a restarted agent
        registers anew), to tell a lost node from one whose agent restarted. `signer`: signs
        the snapshot's manifest (the coordinator's key). `seal`: the job's tenant data key
        its chunks are sealed with (None: stored in plaintext)."""
        self.spec = spec
        self.agents = list(agents)
        self.store = store
        self.stop = stop
        self.settings = settings
        self.freeze_id = f"frz-{secrets.token_hex(6)}"
        self.snapshot_id = snapshot_id(spec.job_id, datetime.now(UTC), secrets.token_hex(2))
        self._on_committed = on_committed
        self._signer = signer
        self.seal = seal
        self._current = current
        self._incarnations = {a.name: a.incarnation for a in self.agents}
        self._prepared: list[AgentHandle] = []
        self._rejoined: list[str] = []
        self._suspended = False
        self._resumed = False
        self._uploaded = False
        self._t_park = 0.0
        self._quiesce_s = 0.0
        self._targets: dict[str, int] = {}
        self._spans: list[pb.Span] = []  # appended to from the event loop's thread
        # Phase calls in flight per node, and when the last one started or ended: what the
        # agent's lease counts from (see _keep_alive).
        self._calls_lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._touched: dict[str, float] = {}
        # The data-link plane the ranks rebuild on at a resume (None: the one they had; a
        # restarted agent re-adopts its ranks on plane 0, so the coordinator always says).
        self.plane: int | None = None


    def upload_request(self) -> agent_pb2.UploadRequest:
        up = agent_pb2.UploadRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, snapshot_id=self.snapshot_id
        )
        if self.seal is not None:
            up.seal.CopyFrom(convert.data_key(self.seal))
        return up
    def _ref(self) -> agent_pb2.FreezeRef:
        return agent_pb2.FreezeRef(job_id=self.spec.job_id, freeze_id=self.freeze_id)

    def _phase_req(self, timeout: float) -> agent_pb2.PhaseRequest:
        req = agent_pb2.PhaseRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, timeout_s=timeout
        )
        if self.plane is not None:
            req.plane = self.plane
        return req

    def _call(self, phase: str, method: str, request: Any, timeout: float | None,
              agents: list[AgentHandle] | None = None) -> parallel.Outcome[str, Any]:  # fmt: skip
        """`method` on every agent of the freeze (or `agents`) at once, each call kept as a
        span of `phase` and counted in flight while it runs (see _keep_alive)."""

        def ended(a: AgentHandle, start: float, end: float) -> None:
            self._calling(a.name, -1)
            self._span(a.name, phase, start, end)

        return call_all(self.agents if agents is None else agents, method, request, timeout,
                        started=lambda a: self._calling(a.name, +1), ended=ended)  # fmt: skip

    def _calling(self, node: str, n: int) -> None:
        """A phase call on `node` starts (+1) or ends (-1): the agent renews its lease at
        both and holds it while the call is in flight (agent/freeze.py), so `_keep_alive`
        need not."""
        with self._calls_lock:
            self._in_flight[node] = self._in_flight.get(node, 0) + n
            self._touched[node] = time.monotonic()

    def _needs_renewal(self, node: str, now: float) -> bool:
        """Whether `node` has been without a call for half of `keepalive_s` (its lease was
        last renewed then)."""
        with self._calls_lock:
            idle = not self._in_flight.get(node, 0)
            return idle and now - self._touched.get(node, 0.0) >= self.settings.keepalive_s / 2

    def _span(self, node: str, phase: str, start: float, end: float, rank: int = -1) -> None:
        self._spans.append(pb.Span(node=node, rank=rank, phase=phase, start=start, end=end))

    def run(self) -> Iterator[coordinator_pb2.FreezeEvent]:
        done = threading.Event()
        self._keep_alive(done)
        try:
            yield from self._run()
        except BaseException as e:
            lost = self._recover(e)
            cause = e.cause if isinstance(e, errors.SnapshotterError) else str(e)
            if lost:
                raise self.failed(
                    f"{cause}; the job cannot go on ({lost}), so it was stopped on every node",
                    "thaw its latest snapshot (`snapshotter list --job "
                    f"{self.spec.job_id}`) onto healthy nodes with --nodes",
                ) from e
            if self._rejoined:
                raise self.failed(
                    f"{cause}; the agent of node(s) {errors.few(self._rejoined)} restarted "
                    f"meanwhile and took its ranks back: the job trains on, {self.outcome}",
                    f"{self.what} again",
                ) from e
            raise
        finally:
            done.set()

    def _keep_alive(self, done: threading.Event) -> None:
        """Renew every agent's lease on this freeze while it runs: a node that is quick in a
        phase must not give up while a slower one still works (agent/freeze.py: leases).
        One thread ticks for all nodes; the renewals are calls on the process's event loop
        (over each agent's Control stream), and a node whose last renewal has not come back is
        skipped, so a node that does not answer never delays the others'. A thread per node, or
        per renewal in flight, was 2,048 threads during a 2,048-node upload (a stream that no
        `_calling` counts, so every node needs renewing while it runs). A
        node with a phase call in flight, or one made within half of `keepalive_s`, has its
        lease renewed by that call: at 2,048 nodes, renewals nobody needs cost a phase's worth of
        calls every `keepalive_s`. Ticking every `keepalive_s` once let a lease of 8 s run
        out: a node last called just after a tick was renewed only ~10 s later."""
        pending: set[str] = set()
        lock = threading.Lock()
        ks = self.settings.keepalive_s

        async def renew(a: AgentHandle) -> None:
            try:
                await a.aio.call("KeepFreeze", self._ref(), ks)
            except Exception:  # noqa: BLE001 - the phase that needs it fails on its own
                pass
            finally:
                with lock:
                    pending.discard(a.name)

        def tick() -> None:
            while not done.wait(ks / 4):
                # self.agents: a node whose agent restarted is renewed at its new handle.
                now = time.monotonic()
                with lock:
                    due = [
                        a for a in self.agents
                        if a.name not in pending and self._needs_renewal(a.name, now)
                    ]  # fmt: skip
                    pending.update(a.name for a in due)
                for a in due:
                    LOOP.soon(renew(a))

        threading.Thread(target=tick, daemon=True, name=f"keep-{self.freeze_id}").start()

    def _quiesce(self) -> Iterator[coordinator_pb2.FreezeEvent]:
        """Prepare, park and suspend every rank (what a freeze and a migration share); sets
        when parking began, how long it took and the targets."""
        s = self.settings
        yield _phase("prepare", snapshot_id=self.snapshot_id)
        req = agent_pb2.PrepareRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, timeout_s=s.prepare_timeout
        )
        out = self._call("prepare", "Prepare", req, s.prepare_timeout + 10)
        self._prepared = [a for a in self.agents if a.name in out.results]
        out.raise_first()
        counts: dict[int, dict[str, int]] = {}
        for reply in out.results.values():
            counts.update({rank: dict(c.issued) for rank, c in reply.counts.items()})
        targets = pick_targets(counts)

        yield _phase("quiesce", targets=targets)
        t_park = time.monotonic()
        park = agent_pb2.ParkRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, targets=targets,
            timeout_s=s.quiesce_timeout,
        )  # fmt: skip
        parked = self._call("park", "Park", park, s.quiesce_timeout + 10)
        parked.raise_first()
        missing = {rank: why for r in parked.results.values() for rank, why in r.missing.items()}
        if missing:
            who = errors.few(sorted(missing))
            # What each rank was doing (agent/unparked.py) is long: two of them say enough.
            detail = errors.few((missing[k] for k in sorted(missing)), limit=2, sep="; ")
            raise errors.QuiesceTimeout(
                f"rank(s) {who} did not reach collective barrier {targets} within "
                f"{s.quiesce_timeout:.0f}s ({detail})",
                "the job was left running as before; retry when the job is in its training "
                "loop, or raise --quiesce-timeout",
            )
        self._t_park, self._quiesce_s, self._targets = t_park, time.monotonic() - t_park, targets

        yield _phase("suspend")
        self._suspended = True
        sus = self._phase_req(s.suspend_timeout)
        self._call("suspend", "Suspend", sus, s.suspend_timeout + 10).raise_first()

    def _run(self) -> Iterator[coordinator_pb2.FreezeEvent]:
        t_start = time.monotonic()
        # Refuse before touching the ranks when the snapshot could not be stored anyway.
        next(iter(self.store.list_keys("snapshots/")), None)
        yield from self._quiesce()
        t_park, quiesce_s, targets = self._t_park, self._quiesce_s, self._targets

        yield _phase("dump")
        t_dump = time.monotonic()
        dumps = self._call("dump", "Dump", self._ref(), None)
        dumps.raise_first()
        dump_s = time.monotonic() - t_dump
        for name, d in dumps.results.items():
            for r in d.ranks:
                if r.dump_end:  # 0: an agent of before per-rank times
                    self._span(name, "dump", r.dump_start, r.dump_end, rank=r.rank)
        image_bytes = sum(r.image_bytes for d in dumps.results.values() for r in d.ranks)

        stall_s: float | None = None
        if not self.stop:
            self._resume()
            stall_s = time.monotonic() - t_park
            yield _phase("resumed", stall_s=stall_s)

        yield _phase("upload", bytes=image_bytes)
        t_up = time.monotonic()
        streams: dict[str, common_pb2.StreamInfo] = {}
        ranks: list[common_pb2.RankRecord] = []
        uploads: list[common_pb2.UploadWindow] = []
        put_keys: set[str] = set()
        failures: dict[str, BaseException] = {}
        self._uploaded = True  # from here on, chunks may exist that a failure must remove
        up = self.upload_request()
        for name, ev in stream_all(self.agents, "Upload", up):
            if isinstance(ev, BaseException):
                failures[name] = ev
            elif ev.HasField("progress"):
                p = common_pb2.TransferProgress()
                p.CopyFrom(ev.progress)
                p.node = name
                yield pb.FreezeEvent(progress=p)
            elif ev.HasField("uploaded"):
                streams.update(ev.uploaded.streams)
                ranks.extend(ev.uploaded.ranks)
                uploads.append(ev.uploaded.upload)
                if ev.uploaded.upload.end:
                    self._span(name, "upload", ev.uploaded.upload.start, ev.uploaded.upload.end)
                put_keys.update(ev.uploaded.put_keys)
        if failures:
            raise _first(failures)
        upload_s = time.monotonic() - t_up

        yield _phase("commit")
        stats = pb.FreezeStats(
            quiesce_s=quiesce_s, dump_s=dump_s, upload_s=upload_s, stall_s=stall_s,
            image_bytes=image_bytes, uploads=uploads,
            uploaded_bytes=sum(u.uploaded_bytes for u in uploads),
        )  # fmt: skip
        job, omitted = self.spec.for_snapshot()
        meta = {
            "job": job,
            "env_omitted": omitted,
            "source_job": self.spec.job_id,
            "freeze_id": self.freeze_id,
            "targets": targets,
            "ranks": [convert.plain(r) for r in sorted(ranks, key=lambda r: r.rank)],
            "nodes": [a.name for a in self.agents],
            "stats": {k: v for k, v in convert.plain(stats).items() if k != "spans"},
        }
        t_commit = time.time()

        def spans() -> dict[str, Any]:
            # The commit's span ends as the manifest is written: the last thing it can say.
            self._span("", "commit", t_commit, time.time())
            self._spans.sort(key=lambda sp: (sp.start, sp.node, sp.rank))
            return {"spans": [convert.plain(sp) for sp in self._spans]}

        commit_snapshot(
            self.store, self.snapshot_id, {n: convert.plain(st) for n, st in streams.items()}, meta,
            put_now=put_keys, signer=self._signer, stamp=spans,
            sealed=None if self.seal is None else fmt.Sealing(self.seal.tenant, self.seal.key_id),
        )  # fmt: skip
        self._on_committed(self.snapshot_id)

        if self.stop:
            yield _phase("stop")
        fin = agent_pb2.FinishFreezeRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, stop=self.stop, committed=True
        )
        self._call("finish", "FinishFreeze", fin, 60)
        stats.total_s = time.monotonic() - t_start
        stats.spans.extend(self._spans)
        yield pb.FreezeEvent(
            done=pb.FreezeDone(snapshot_id=self.snapshot_id, stopped=self.stop, stats=stats)
        )

    def _resume(self) -> None:
        s = self.settings
        req = self._phase_req(s.resume_timeout)
        out = self._call("resume", "Resume", req, s.resume_timeout + 10)
        self._resumed = True
        if out.failures:
            first = _first(out.failures)
            raise errors.FreezeFailed(
                f"ranks could not rebuild their communicators after the dump: {first}",
                "the job is likely stuck; cancel it and thaw the last snapshot",
            ) from first

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
                call_all(self.agents, "DiscardUpload", self._ref(), 30)
            job = common_pb2.JobRef(job_id=self.spec.job_id)
            call_all([a for a in self.agents if a.name not in silent], "Cancel", job, 60)
            return lost_text(silent, ended)
        self._restore_job()
        return ""

    def _lost_nodes(self) -> tuple[list[str], list[str]]:
        """Nodes whose agent does not answer, and nodes whose ranks have ended."""
        job = common_pb2.JobRef(job_id=self.spec.job_id)
        out = call_all(self.agents, "Status", job, 10)
        ended = [n for n, st in out.results.items() if st.state in ("FAILED", "CANCELLED")]
        silent = sorted(out.failures)
        # An agent that answers may still be a new incarnation (restarted under its keeper,
        # at the same address): it knows nothing of this freeze.
        pinged = call_all([a for a in self.agents if a.name in out.results], "Ping",
                          common_pb2.Empty(), 5)  # fmt: skip
        restarted = sorted(n for n, r in pinged.results.items()
                           if r.incarnation != self._incarnations[n])  # fmt: skip
        # A new agent that re-adopted the node's ranks lets go those this freeze parked, and
        # leaves those it suspended to this freeze's resume (agent/settle.py): every node's
        # ranks rebuild their communicators together.
        if self._current is not None:
            # Worth waiting for: a node whose port refuses at once (its kernel is alive and
            # nothing listens: the agent is gone, and a keeper starts it again). One that
            # does not answer at all (stopped, hung, unplugged) is lost now.
            back = on_all([a for a in self.agents if a.name in silent], _refuses_at_once)
            gone = [n for n in silent if not back.results.get(n)]
            left = self._await_rejoin([n for n in silent if n not in gone] + restarted)
            return sorted(gone + left), sorted(ended)
        return sorted(silent + restarted), sorted(ended)

    def _await_rejoin(self, silent: list[str]) -> list[str]:
        """Wait up to `rejoin_s` for the silent nodes' agents to come back (a new incarnation
        that re-adopted the job's ranks); use those from now on. Returns the still silent."""
        assert self._current is not None
        job = common_pb2.JobRef(job_id=self.spec.job_id)
        deadline = time.monotonic() + self.settings.rejoin_s
        left = list(silent)
        while left and time.monotonic() < deadline:
            for name in list(left):
                h = self._current(name)
                if h is None or h.incarnation == self._incarnations[name]:
                    continue
                try:
                    st = h.stub.Status(job, timeout=5)
                except errors.SnapshotterError:
                    continue
                if st.state != "RUNNING":
                    continue
                log.warning("agent of node %s restarted during freeze %s and re-adopted the "
                            "job's ranks", name, self.freeze_id)  # fmt: skip
                left.remove(name)
                self._rejoined.append(name)
                self.agents = [h if a.name == name else a for a in self.agents]
                # It never saw this freeze: nothing of it to finish or abort there.
                self._prepared = [a for a in self._prepared if a.name != name]
            if left:
                time.sleep(0.5)
        return left

    def _restore_job(self) -> None:
        if self._uploaded:
            call_all(self.agents, "DiscardUpload", self._ref(), 120)
        if self._suspended and not self._resumed:
            try:
                self._resume()
            except errors.SnapshotterError as e:
                log.error("resume after failed freeze failed: %s", e)
        elif self._prepared and not self._suspended:
            call_all(self._prepared, "Abort", self._ref(), 60)
            return  # Abort released the agents' freeze state
        fin = agent_pb2.FinishFreezeRequest(job_id=self.spec.job_id, freeze_id=self.freeze_id)
        call_all(self._prepared, "FinishFreeze", fin, 60)
