"""Moving every rank of one node onto another while the other ranks stay in memory (a drain).

    prepare   every rank reports its collective counts       (failure: nothing to undo)
    quiesce   every rank parks before the chosen target      (failure: abort, as a freeze)
    suspend   every rank closes its sockets                  (failure: resume all)
    dump      CRIU dumps the moving node's ranks only        (failure: resume all)
    transfer  the target agent reads the images straight from the source agent, each rank's
              verified whole (agent/handoff.py)              (failure: resume all, in place)
    restore   the target restores them under the source's node rank while every other node
              resumes, all under the freeze's epoch: every rank rebuilds its communicators
              with the moved ranks' new addresses         (failure: the source resumes its own)
    finish    the source's parked copies end; the job's record names the target

The other nodes' ranks never leave memory. Until the target's ranks rebuilt their
communicators, the source's ranks are parked, not ended, so any failure puts them back where
they were, running. Moving node 0 moves the job's rendezvous server too: the target opens a
new one during the transfer and every other node resumes against it (and tells its keeper,
for a restarted agent); a restore that fails then cannot put the source back (the others
were pointed at the new server), so the job is stopped everywhere, as a freeze that lost a
node stops it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from snapshotter import errors, metrics
from snapshotter.coordinator import detect
from snapshotter.coordinator.agents import AgentHandle, call_all, on_all, open_rdzv_req
from snapshotter.coordinator.decisions import JobPhase
from snapshotter.coordinator.freeze import FreezeOperation, FreezeSettings
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import convert
from snapshotter.storage.api import ObjectStore
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator, JobRecord

log = logging.getLogger(__name__)
pb = coordinator_pb2
_RETRY = "the job trains on where it was; retry the migration"


def _phase(phase: str, **kw: object) -> pb.MigrateEvent:
    return pb.MigrateEvent(phase=common_pb2.PhaseEvent(phase=phase, **kw))  # type: ignore[arg-type]


class MigrateOperation(FreezeOperation):
    what = "migrate"
    failed = errors.MigrationFailed
    outcome = "where it was"

    def __init__(
        self,
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        source: int,
        target: AgentHandle,
        store: ObjectStore,
        settings: FreezeSettings,
        on_moved: Callable[[], list[str]],
        current: Callable[[str], AgentHandle | None] | None = None,
        ranks: Sequence[int] = (),
        source_agent: AgentHandle | None = None,
        via_store: bool = False,
    ) -> None:
        """`source`: the node rank whose ranks move (with `ranks`, only those, from
        `source_agent`, which may hold ranks of another node rank too); `on_moved()`: record
        that the moved ranks run on the target now, and return the job's nodes (called
        before the source's parked copies end)."""
        super().__init__(spec, agents, store, False, settings, lambda _: None, current)
        self.via_store = via_store
        if not via_store:
            self.snapshot_id = ""  # nothing is stored
        self.source_rank = source
        self.ranks = sorted(ranks)
        self.source = source_agent if source_agent is not None else self.agents[source]
        self.target = target
        self._on_moved = on_moved
        self._op = ""
        self._opening = False
        self._done = pb.MigrateEvent()

    def events(self) -> Iterator[pb.MigrateEvent]:
        for ev in self.run():
            if ev.HasField("phase"):
                yield pb.MigrateEvent(phase=ev.phase)
            elif ev.HasField("progress"):
                yield pb.MigrateEvent(progress=ev.progress)
        yield self._done

    def _run(self) -> Iterator[coordinator_pb2.FreezeEvent]:
        s = self.settings
        job = common_pb2.JobRef(job_id=self.spec.job_id)
        rdzv = self.agents[0].stub.Status(job, timeout=10).rdzv
        # The rendezvous server lives with node 0's agent: it moves only when that node does.
        moves_rdzv = self.source_rank == 0 and not self.ranks
        yield from self._quiesce()

        src, dst = self.source, self.target
        yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase="dump", node=src.name))
        t = time.monotonic()
        dump_ref = self._ref()
        dump_ref.ranks.extend(self.ranks)
        ranks = list(src.stub.Dump(dump_ref, timeout=None).ranks)
        dump_s = time.monotonic() - t
        image_bytes = sum(r.image_bytes for r in ranks)

        yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase="transfer", node=dst.name,
                                                         bytes=image_bytes))  # fmt: skip
        t = time.monotonic()
        opened: dict[str, Any] = {}
        opener = threading.Thread(target=self._open_rdzv, args=(opened,), daemon=True)
        if moves_rdzv:  # the target's server imports the job's torch while the bytes move
            self._opening = True
            opener.start()
        if self.via_store:
            yield from self._through_store(ranks)
        else:
            yield from self._agent_to_agent(ranks, image_bytes)
        transfer_s = time.monotonic() - t
        if moves_rdzv:
            opener.join()
            if "error" in opened:
                raise errors.MigrationFailed(
                    f"node {dst.name} could not start the job's rendezvous server: "
                    f"{opened['error']}", _RETRY,
                ) from opened["error"]  # fmt: skip
            rdzv = opened["rdzv"]

        yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase="restore", node=dst.name))
        restore = agent_pb2.RestoreRequest(
            op=self._op, spec=self.spec.to_proto(), ranks=ranks, node_rank=self.source_rank,
            timeout_s=s.resume_timeout, rdzv=rdzv, epoch=self.freeze_id, put_back_files=True,
            plane=self.plane or 0,
            seal=convert.data_key(self.seal) if self.seal is not None and self.spec.sealed
            else None,
        )  # fmt: skip
        resume = self._phase_req(s.resume_timeout)
        moved = agent_pb2.PhaseRequest()
        moved.CopyFrom(resume)
        if moves_rdzv:
            moved.rdzv.CopyFrom(rdzv)
        # Single ranks: the source's other ranks resume with everyone, the moving ones stay
        # parked there until the target's have rebuilt.
        stays = agent_pb2.PhaseRequest()
        stays.CopyFrom(resume)
        stays.skip_ranks.extend(self.ranks)
        others = [a for a in self.agents if a is not src or self.ranks]
        self._resumed = True  # from here on, every failure is handled below

        def step(a: AgentHandle) -> object:
            if a is dst:
                return dst.stub.Restore(restore, timeout=None)
            req = stays if a is src else moved
            return a.stub.Resume(req, timeout=s.resume_timeout + 10)

        def put_back(failed: AgentHandle, e: BaseException) -> None:
            # The others wait for the moved ranks under this epoch: the source's parked
            # ranks join them instead, where they were (not when the others were pointed at
            # a new rendezvous server: then they are stopped at once, not at their deadline).
            if failed is dst and not moves_rdzv:
                src.stub.Resume(resume, timeout=s.resume_timeout + 10)
            elif failed is dst:
                call_all(others, "Cancel", job, 60)

        out = on_all([dst, *others], step, first_failure=put_back)
        if out.failures:
            self._fail_after_restore(out.failures, dst, put_back=not moves_rdzv)
        restored = out.results[dst.name]
        assert isinstance(restored, agent_pb2.RestoreReply)
        downtime_s = time.monotonic() - self._t_park

        nodes = self._on_moved()
        yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase="finish", node=src.name))
        if self.via_store:  # restored: the chunks in the store served their purpose
            try:
                src.stub.DiscardUpload(self._ref(), timeout=120)
            except errors.SnapshotterError as e:
                log.warning("migration %s left chunks of %s for gc: %s", self.freeze_id,
                            self.snapshot_id, e)  # fmt: skip
        self._finish(src, stop=True)
        for a in others:
            if a is not src:
                self._finish(a, stop=False)
        self._prepared = []  # nothing left for a failure to put back
        self._done = pb.MigrateEvent(done=pb.MigrateDone(
            job_id=self.spec.job_id, node=src.name, to=dst.name, nodes=nodes,
            stats=pb.MigrateStats(
                downtime_s=downtime_s, quiesce_s=self._quiesce_s, dump_s=dump_s,
                transfer_s=transfer_s, restore_s=restored.restore_s, resume_s=restored.resume_s,
                image_bytes=image_bytes, ranks=sorted(r.rank for r in ranks),
            ),
        ))  # fmt: skip

    def _agent_to_agent(
        self, ranks: list[common_pb2.RankRecord], image_bytes: int
    ) -> Iterator[coordinator_pb2.FreezeEvent]:
        """The target reads the images straight from the source (agent/handoff.py)."""
        src, dst = self.source, self.target
        ticket = secrets.token_urlsafe(32)
        recv = agent_pb2.ReceiveRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, ticket=ticket,
            source=src.address, source_name=src.name, streams=[r.stream for r in ranks],
            bytes=image_bytes,
        )  # fmt: skip
        try:
            src.stub.OfferImages(agent_pb2.OfferRequest(
                job_id=self.spec.job_id, freeze_id=self.freeze_id, ticket=ticket), timeout=30)
        except errors.SnapshotterError as e:
            raise errors.MigrationFailed(
                f"node {src.name} could not offer its ranks' images: {e.cause}", _RETRY
            ) from e
        yield from self._taken(
            lambda: dst.stub.Receive(recv, timeout=self.settings.resume_timeout + 600),
            f"node {dst.name} could not take the images of node {src.name}",
        )

    def _taken(
        self, call: Callable[[], Iterator[agent_pb2.FetchEvent]], failed: str
    ) -> Iterator[coordinator_pb2.FreezeEvent]:
        """The target's side of a transfer: its progress passed on, its op kept for the
        restore; a failure says `failed` and why."""
        try:
            for ev in call():
                if ev.HasField("progress"):
                    yield pb.FreezeEvent(progress=ev.progress)
                elif ev.HasField("fetched"):
                    self._op = ev.fetched.op
        except errors.SnapshotterError as e:
            raise errors.MigrationFailed(f"{failed}: {e.cause}", _RETRY) from e

    def _through_store(
        self, ranks: list[common_pb2.RankRecord]
    ) -> Iterator[coordinator_pb2.FreezeEvent]:
        """`--via-store`: the source uploads the images as chunks of a snapshot that is never
        committed (no manifest: invisible to `list` and `thaw`, an orphan for `gc` if this
        coordinator dies), the target fetches them from the chunk list the source reported,
        each chunk checked against its sha256, and the chunks are deleted once restored."""
        src, dst = self.source, self.target
        up = self.upload_request()
        streams: dict[str, common_pb2.StreamInfo] = {}
        self._uploaded = True  # from here on, a failure deletes the chunks
        try:
            for ev in src.stub.Upload(up):
                if ev.HasField("progress"):
                    yield pb.FreezeEvent(progress=ev.progress)
                elif ev.HasField("uploaded"):
                    streams.update(ev.uploaded.streams)
        except errors.SnapshotterError as e:
            raise errors.MigrationFailed(
                f"node {src.name} could not upload its ranks' images: {e.cause}", _RETRY
            ) from e
        fetch = agent_pb2.FetchRequest(
            snapshot_id=self.snapshot_id, streams=[r.stream for r in ranks], uncommitted=streams
        )
        if self.seal is not None:
            fetch.seal.CopyFrom(convert.data_key(self.seal))
        yield from self._taken(
            lambda: dst.stub.Fetch(fetch, timeout=self.settings.resume_timeout + 600),
            f"node {dst.name} could not fetch the images of node {src.name} from the store",
        )

    def _finish(self, a: AgentHandle, stop: bool) -> None:
        """End the freeze on `a`; `stop`: the moved ranks' parked copies end there (all of
        the source's ranks, or the single ranks that moved)."""
        fin = agent_pb2.FinishFreezeRequest(
            job_id=self.spec.job_id, freeze_id=self.freeze_id, stop=stop and not self.ranks
        )
        if stop:
            fin.stop_ranks.extend(self.ranks)
        try:
            a.stub.FinishFreeze(fin, timeout=60)
        except errors.SnapshotterError as e:
            # Its lease ends the freeze there on its own (and, on the source, its ranks are
            # no longer the job's: the target's run under the job's record).
            if stop and not self.ranks:
                a.stub.Cancel(common_pb2.JobRef(job_id=self.spec.job_id), timeout=60)
            raise errors.MigrationFailed(
                f"the job runs on its new nodes, but node {a.name} did not finish the "
                f"migration: {e.cause}",
                "check that node's agent (`snapshotter nodes`)",
            ) from e

    def _fail_after_restore(
        self, failures: dict[str, BaseException], dst: AgentHandle, put_back: bool
    ) -> None:
        """The target's restore or another node's resume failed: if every rank but the
        target's resumed (the source's in place), the job trains on where it was."""
        job = common_pb2.JobRef(job_id=self.spec.job_id)
        first = next(iter(failures.values()))
        cause = first.cause if isinstance(first, errors.SnapshotterError) else str(first)
        if put_back and set(failures) == {dst.name}:
            for a in self.agents:
                self._finish(a, stop=False)
            self._prepared = []
            raise errors.MigrationFailed(
                f"node {dst.name} could not restore the ranks of node {self.source.name} "
                f"({cause}); they resumed on {self.source.name}", _RETRY,
            ) from first  # fmt: skip
        call_all([*self.agents, dst], "Cancel", job, 60)
        self._prepared = []
        raise errors.MigrationFailed(
            f"the job's ranks could not rebuild their communicators after the migration "
            f"({cause}), so it was stopped on every node",
            f"thaw its latest snapshot (`snapshotter list --job {self.spec.job_id}`)",
        ) from first

    def _open_rdzv(self, out: dict[str, Any]) -> None:
        try:
            out["rdzv"] = self.target.stub.OpenRdzv(open_rdzv_req(self.spec), timeout=90)
        except BaseException as e:  # noqa: BLE001 - raised before the restore
            out["error"] = e

    def _recover(self, cause: BaseException) -> str:
        if self._opening:  # a rendezvous server opened for the moved node 0, never claimed
            try:
                self.target.stub.CloseRdzv(common_pb2.JobRef(job_id=self.spec.job_id),
                                           timeout=30)  # fmt: skip
            except errors.SnapshotterError:
                pass  # the target is gone, or its housekeeping stops it
        if self._op:
            try:
                self.target.stub.DiscardFetch(agent_pb2.FetchRef(op=self._op), timeout=30)
            except errors.SnapshotterError:
                pass  # the target is gone, or its housekeeping removes it
        return super()._recover(cause)


def migrate(c: Coordinator, req: pb.MigrateRequest) -> Iterator[pb.MigrateEvent]:
    """Move the ranks of node `req.node` (or only rank `req.rank`) of a running job onto
    node `req.to`."""
    return metrics.observed("migrate", _migrate(c, req))


def _migrate(c: Coordinator, req: pb.MigrateRequest) -> Iterator[pb.MigrateEvent]:
    rec = c.job(req.job_id)
    source, target, ranks, src_name = _check(c, req, rec)
    with c.holding(rec, JobPhase.MIGRATING):
        timeout = req.quiesce_timeout_s if req.HasField("quiesce_timeout_s") else None
        settings = FreezeSettings(quiesce_timeout=timeout or FreezeSettings.quiesce_timeout)
        handles = c.job_handles(rec)
        if len(handles) != len(rec.agents):
            down = sorted(set(rec.agents) - {a.name for a in handles})
            raise errors.FreezeRefused(
                f"node(s) {', '.join(down)} of job {rec.spec.job_id} do not answer",
                "wait for them to answer again (`snapshotter nodes`), or freeze and thaw",
            )

        def moved() -> list[str]:
            if ranks:
                for r in ranks:
                    rec.moved[r] = req.to
            else:
                rec.nodes[source] = req.to
            rec.settle_moved()
            return rec.agents

        src = next(a for a in handles if a.name == src_name)
        op = MigrateOperation(rec.spec, handles, source, target, c.store, settings, moved,
                              current=lambda n: c.live_agents().get(n), ranks=ranks,
                              source_agent=src, via_store=req.via_store)  # fmt: skip
        op.plane = rec.plane
        op.seal = c.seal_for(rec.spec)
        with c.writing_snapshot(op.snapshot_id if req.via_store else None):
            yield from _events(op, rec, src_name, req.to)


def _events(
    op: MigrateOperation, rec: JobRecord, src_name: str, to: str
) -> Iterator[pb.MigrateEvent]:
    """The operation's events; its end recorded as the job's `migrated` event."""
    how = " through the store" if op.via_store else ""
    for ev in op.events():
        if ev.HasField("done"):
            st = ev.done.stats
            rec.life.add("migrated", nodes=list(ev.done.nodes), took_s=st.downtime_s,
                         detail=f"rank(s) {', '.join(map(str, st.ranks))} moved from "
                         f"{src_name} to {to}{how}: job stalled {st.downtime_s:.2f}s "
                         f"(transfer {st.transfer_s:.2f}s)")  # fmt: skip
            # It held collectives on purpose: no rank was hung meanwhile.
            rec.life.progress = detect.reset(rec.life.progress, time.monotonic())
        yield ev


def _check(
    c: Coordinator, req: pb.MigrateRequest, rec: JobRecord
) -> tuple[int, AgentHandle, list[int], str]:
    """(the moving ranks' node rank, the target's agent, the single ranks that move (empty:
    the whole node), the source agent). Raises: InvalidArgument naming what is wrong."""
    agents = rec.agents
    if req.HasField("rank") == bool(req.node) or not req.to:
        raise errors.InvalidArgument(
            "a migration needs --to and one of --node or --rank", "name what moves and where"
        )
    ranks: list[int] = []
    if req.HasField("rank"):
        world = rec.spec.nnodes * rec.spec.nproc_per_node
        if not 0 <= req.rank < world:
            raise errors.InvalidArgument(
                f"rank {req.rank} is out of range: job {req.job_id} has ranks 0..{world - 1}",
                "`snapshotter status JOB` lists its ranks",
            )
        src_name = rec.holder(req.rank)
        if [r for r in range(world) if rec.holder(r) == src_name] == [req.rank]:
            raise errors.InvalidArgument(
                f"rank {req.rank} is the only rank of job {req.job_id} on node {src_name}",
                f"move the node with --node {src_name}",
            )
        source, ranks = req.rank // rec.spec.nproc_per_node, [req.rank]
    else:
        if req.node not in agents:
            raise errors.InvalidArgument(
                f"node {req.node!r} holds no rank of job {req.job_id}",
                f"the job runs on {', '.join(agents)}",
            )
        if req.node not in rec.nodes:
            raise errors.InvalidArgument(
                f"node {req.node} holds only single ranks of job {req.job_id} moved there",
                "move them with --rank",
            )
        src_name, source = req.node, rec.nodes.index(req.node)
    if req.to in agents:
        raise errors.InvalidArgument(
            f"node {req.to!r} already holds ranks of job {req.job_id}",
            "migrate onto a node the job does not use (`snapshotter nodes`)",
        )
    if req.to in c.draining:
        raise errors.InvalidArgument(f"node {req.to} is being drained", "choose another node")
    target = c.live_agents().get(req.to)
    if target is None:
        raise errors.InvalidArgument(
            f"node {req.to!r} is not registered or its agent does not answer",
            "`snapshotter nodes` lists the live nodes",
        )
    return source, target, ranks, src_name
