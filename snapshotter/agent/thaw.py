"""A thaw on one node: fetch (download and verify every chunk of this node's ranks, unpack
the images), then restore (CRIU restores every rank in parallel; they resume with this node's
rendezvous address and network settings).

No process starts before every chunk verified; a failed restore leaves no process behind and
the snapshot untouched. A fetch that is never restored nor discarded (its coordinator died)
expires in the agent's housekeeping. A fetch (or a migration's receive) reports the raw bytes
it moved of the total it knows every PROGRESS_EVERY_S, and once more when it is complete.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from snapshotter import errors, parallel
from snapshotter.agent import handoff, retention
from snapshotter.agent.freeze import Freezes
from snapshotter.agent.launch import check_launch, undo
from snapshotter.agent.local_copy import LocalCopies
from snapshotter.agent.rdzv import RdzvHost
from snapshotter.agent.runtime import JobTable, NodeJob, NodeJobState, RankRuntime
from snapshotter.agent.sandboxes import Sandboxes
from snapshotter.config import Paths
from snapshotter.gpu.stage import GpuStage, records_of
from snapshotter.launch import rootcause
from snapshotter.launch.env import RankPlacement, RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import convert
from snapshotter.rpc.client import Target, agent_client
from snapshotter.rpc.tls import TlsFiles
from snapshotter.sandbox import criu, files
from snapshotter.sandbox.spawn import PRIVATE_TMP
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.sealing import Seal
from snapshotter.storage.transfer import SnapshotReader
from snapshotter.v1 import agent_pb2, common_pb2

PROGRESS_EVERY_S = 0.5  # how often a fetch or receive in progress reports its bytes


class Thaws:
    def __init__(
        self,
        node: str,
        paths: Paths,
        store: ObjectStore,
        jobs: JobTable,
        sandboxes: Sandboxes,
        rdzv: RdzvHost,
        freezes: Freezes,
        gpu: Callable[[], GpuStage | None],
        netns: str | None,
        parallelism: int,
        copies: LocalCopies | None = None,
        peer_tls: TlsFiles | None = None,
    ) -> None:
        """`peer_tls`: this node's certificate, with which it reads a migrating rank's
        images from another node's agent (None: plaintext, tests on loopback)."""
        self.node = node
        self.peer_tls = peer_tls
        self.copies = copies
        self.paths = paths
        self.store = store
        self.jobs = jobs
        self.sandboxes = sandboxes
        self.rdzv = rdzv
        self.freezes = freezes
        self.gpu = gpu
        self.netns = netns
        self.parallelism = parallelism
        self._lock = threading.Lock()
        self._fetched: dict[str, float] = {}  # op -> when its fetch completed (monotonic)

    def fetch(
        self, snapshot_id: str, streams: list[str],
        uncommitted: dict[str, Any] | None = None, digest: str = "", seal: Seal | None = None,
    ) -> Iterator[agent_pb2.FetchEvent]:  # fmt: skip
        """Download and verify every chunk of `streams`, then unpack them, or take them from
        this node's local copy once it matched the committed manifest. Phase one of a thaw:
        no process starts before every node fetched. `uncommitted`: the streams' chunk lists
        of a migration through the store, which commits no manifest. `digest`: the sha256 of
        the manifest whose signature the coordinator checked; another manifest is refused.
        `seal`: the data key of a sealed snapshot."""
        op = f"thaw-{uuid.uuid4().hex[:12]}"
        work = self.paths.work_dir(op)
        reader = SnapshotReader(self.store, snapshot_id, uncommitted=uncommitted, digest=digest,
                                seal=seal)  # fmt: skip
        t0 = time.monotonic()
        local = False
        try:
            yield agent_pb2.FetchEvent(phase=common_pb2.PhaseEvent(phase="fetch", node=self.node))
            manifest = reader.manifest()  # the store decides what the snapshot is
            mine = [manifest.streams[s] for s in streams if s in manifest.streams]
            total = sum(s.raw_size for s in mine)
            stored = sum(s.stored_size for s in mine)
            got = _Count()

            def sample() -> agent_pb2.FetchEvent:
                n = got.value
                return agent_pb2.FetchEvent(progress=common_pb2.TransferProgress(
                    node=self.node, raw_bytes=n, total_bytes=total,
                    # Chunks are counted raw: the stored bytes are their share of the stored
                    # total (exact at the start and the end).
                    stored_bytes=stored * n // total if total else 0,
                    rate=n / max(time.monotonic() - began, 1e-6)))  # fmt: skip

            began = time.monotonic()
            if self.copies is not None and uncommitted is None:
                work.mkdir(parents=True, exist_ok=True)
                local = self.copies.take(manifest, streams, work, self.parallelism, seal)
            if local:
                got.add(total)
                yield sample()
            else:
                # Streamed from the store into each rank's directory, every chunk checked
                # before it is unpacked; nothing is staged.
                dests = {s: work / s for s in streams}
                began = time.monotonic()
                yield from _while_running(
                    lambda: reader.fetch_and_extract(dests, progress=got.add), sample,
                    name=f"fetch-{op}",
                )  # fmt: skip
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        with self._lock:
            self._fetched[op] = time.monotonic()
        yield agent_pb2.FetchEvent(
            fetched=agent_pb2.Fetched(
                node=self.node, op=op, fetch_s=time.monotonic() - t0, local_copy=local
            )
        )

    def receive(
        self,
        source: str,
        source_name: str,
        job_id: str,
        freeze_id: str,
        ticket: str,
        streams: list[str],
        size: int = 0,
    ) -> Iterator[agent_pb2.FetchEvent]:
        """Take a migrating node's dumped rank images (`size` bytes) straight from its agent,
        every rank's in parallel, each verified whole before it counts (agent/handoff.py): a
        migration's fetch. Its op is restored like a thaw's.

        Raises: MigrationFailed at once when this node has no room for them."""
        op = f"thaw-{uuid.uuid4().hex[:12]}"
        work = self.paths.work_dir(op)
        handoff.check_room(work.parent, size, self.node)
        t0 = time.monotonic()
        yield agent_pb2.FetchEvent(phase=common_pb2.PhaseEvent(phase="receive", node=self.node))
        client = agent_client(Target(source, tls=self.peer_tls, server_name=source_name),
                              peer="agent")  # fmt: skip
        got = _Count()

        def one(stream: str) -> int:
            req = agent_pb2.ImagesRequest(
                job_id=job_id, freeze_id=freeze_id, ticket=ticket, stream=stream
            )
            return handoff.receive(client.stub.ReadImages(req), work / stream, got.add)

        def sample() -> agent_pb2.FetchEvent:
            n = got.value
            # `size` counts the same bytes (the images' file data); never below what came.
            return agent_pb2.FetchEvent(progress=common_pb2.TransferProgress(
                node=self.node, raw_bytes=n, stored_bytes=n,
                total_bytes=max(size, n) if size else 0,
                rate=n / max(time.monotonic() - t0, 1e-6)))  # fmt: skip

        try:
            yield from _while_running(
                lambda: parallel.each(streams, one, key=lambda st: st, workers=self.parallelism,
                                      name="receive").raise_first(),
                sample, name=f"receive-{op}",
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            client.close()
        with self._lock:
            self._fetched[op] = time.monotonic()
        yield agent_pb2.FetchEvent(
            fetched=agent_pb2.Fetched(node=self.node, op=op, fetch_s=time.monotonic() - t0)
        )

    def discard(self, op: str) -> None:
        if op.startswith("thaw-") and "/" not in op:
            with self._lock:
                self._fetched.pop(op, None)
            shutil.rmtree(self.paths.work_dir(op), ignore_errors=True)

    def live_ops(self) -> set[str]:
        with self._lock:
            return set(self._fetched)

    def expire(self, ttl_s: float) -> list[str]:
        with self._lock:
            stale = retention.expired(self._fetched, time.monotonic(), ttl_s)
        for op in stale:
            self.discard(op)
        return stale

    def restore(
        self,
        op: str,
        spec: JobSpec,
        ranks: list[common_pb2.RankRecord],
        node_rank: int,
        timeout: float,
        rdzv_at: RdzvAddress | None,
        epoch: str,
        put_back_files: bool = True,
        plane: int = 0,
    ) -> agent_pb2.RestoreReply:
        """Restore this node's ranks from a fetched snapshot, in parallel, then resume them
        with this node's rendezvous address and network settings."""
        work = self.paths.work_dir(op)
        if not work.is_dir():
            raise errors.ThawFailed(
                f"nothing fetched for thaw {op} on node {self.node}",
                "retry the thaw; the fetch phase must complete first",
            )
        cancelled = self.jobs.begin_launch(spec.job_id)
        job: NodeJob | None = None
        watched = False
        try:
            # Refuse before any process starts when this node cannot take the GPU state.
            recorded = records_of([convert.plain(r) for r in ranks])
            stage = self.gpu() if recorded else None
            if recorded and stage is None:
                raise errors.GpuRemapRefused(
                    f"the snapshot holds GPU state of rank(s) {sorted(recorded)}, and node "
                    f"{self.node} has no usable NVIDIA driver",
                    "thaw onto a node with NVIDIA GPUs of the snapshot's type (r550+ driver)",
                )
            mapping = stage.plan(recorded) if stage is not None else {}
            server, remote = self.rdzv.claim(spec, rdzv_at)
            job = NodeJob(spec=spec, node_rank=node_rank, rdzv=server, remote_rdzv=remote,
                          plane=plane)  # fmt: skip
            # Held until the ranks are resumed: the job is visible from `end_launch` on, and
            # until then its channels are this thaw's (a progress sample reports it busy).
            job.op_lock.acquire()
            logs = self.paths.criu_logs(op)

            def one(rec: common_pb2.RankRecord) -> RankRuntime:
                init_cwd = Path(rec.init_cwd)
                files.prepare_restore(work / rec.stream, put_back_files, [str(PRIVATE_TMP)])
                self.sandboxes.reserve(init_cwd)
                try:
                    # What a rank of this sandbox wrote before (the failure this thaw recovers
                    # from) is not this rank's root cause; a path the job chose is left alone.
                    if rootcause.VAR not in spec.env:
                        (init_cwd / rootcause.FILE_NAME).unlink(missing_ok=True)
                    sb = criu.restore(
                        work / rec.stream, dict(rec.inodes), log_dir=logs / rec.stream,
                        netns=self.netns,
                    )  # fmt: skip
                except BaseException:
                    self.sandboxes.release(init_cwd)
                    raise
                p = RankPlacement(
                    rank=rec.rank,
                    local_rank=rec.local_rank,
                    node_rank=node_rank,
                    world_size=spec.world_size,
                    local_world_size=spec.nproc_per_node,
                    nnodes=spec.nnodes,
                )
                return self.sandboxes.adopt(p, sb, job, rec.init_cwd)

            t1 = time.monotonic()
            out = parallel.each(ranks, one, key=lambda r: r.rank, workers=self.parallelism,
                                name="restore")  # fmt: skip
            job.ranks.extend(out.results[r.rank] for r in ranks if r.rank in out.results)
            out.raise_first()
            check_launch(spec.job_id, cancelled)
            restore_s = time.monotonic() - t1
            self.jobs.end_launch(spec.job_id, job)
            job.watch()
            watched = True
            reply = agent_pb2.RestoreReply(node=self.node)
            if stage is not None:
                t_gpu = time.monotonic()
                thawed = stage.thaw({r.rank: r.sandbox.pid for r in job.ranks}, recorded, mapping)
                for rank, g in thawed.items():
                    reply.gpu[rank].CopyFrom(convert.parse(g, agent_pb2.GpuThaw))
                restore_s += time.monotonic() - t_gpu
            t2 = time.monotonic()
            # Every node's ranks rebuild under one epoch (the coordinator's thaw id).
            self.freezes.resume_ranks(job, job.rdzv_address, epoch or op, timeout)
            reply.restore_s = restore_s
            reply.resume_s = time.monotonic() - t2
            reply.job.CopyFrom(job.to_proto())
            return reply
        except BaseException as e:
            if job is not None and watched:
                job.stop(NodeJobState.FAILED)  # its watchers release what the ranks hold
            else:
                if job is not None:
                    undo(job, e, self.node)
                self.jobs.end_launch(spec.job_id, None)
            raise
        finally:
            if job is not None:
                job.op_lock.release()
            with self._lock:
                self._fetched.pop(op, None)
            shutil.rmtree(work, ignore_errors=True)


class _Count:
    """Bytes moved so far, added to from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._n += n

    @property
    def value(self) -> int:
        with self._lock:
            return self._n


def _while_running(
    work: Callable[[], object], sample: Callable[[], agent_pb2.FetchEvent], name: str
) -> Iterator[agent_pb2.FetchEvent]:
    """Run `work` in a thread of its own, yielding `sample()` every PROGRESS_EVERY_S while it
    runs and once more when it succeeded; what it raised is raised here. Closed early (the
    caller went away), it waits for `work` to end, so that its files can be removed."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
            failed.append(e)

    worker = threading.Thread(target=run, daemon=True, name=name)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(PROGRESS_EVERY_S)
            if worker.is_alive():
                yield sample()
    finally:
        worker.join()
    if failed:
        raise failed[0]
    yield sample()
