"""Thaw a committed snapshot into a running job, in two phases across the chosen nodes.

    fetch    every node downloads and verifies every chunk of its ranks, in parallel
             (a missing or altered chunk fails here: no process has started)
    restore  every node restores its ranks with CRIU and resumes them with its own store
             address and network settings

A failure in either phase leaves no process behind and the snapshot untouched.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from snapshotter import errors
from snapshotter.coordinator.agents import AgentHandle, call_all, open_rdzv_req, stream_all
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc import convert
from snapshotter.storage.sealing import Seal
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2

pb = coordinator_pb2


def ranks_by_node(meta: dict[str, Any], nnodes: int) -> list[list[common_pb2.RankRecord]]:
    """The snapshot's rank records grouped by the node rank they ran on.

    Raises: SnapshotCorrupt if a record is malformed or names a node the job does not have.
    """
    out: list[list[common_pb2.RankRecord]] = [[] for _ in range(nnodes)]
    for r in meta.get("ranks", []):
        try:
            rec = convert.parse(r, common_pb2.RankRecord)
            out[rec.node_rank].append(rec)
        except (IndexError, ValueError) as e:
            raise errors.SnapshotCorrupt(
                f"a rank record of the snapshot is malformed ({e}): {r!r}",
                "thaw an older snapshot of the job",
            ) from e
    return out


class ThawOperation:
    def __init__(
        self,
        snapshot_id: str,
        meta: dict[str, Any],
        spec: JobSpec,
        agents: Sequence[AgentHandle],
        resume_timeout: float = 120.0,
        fork_of_live_job: bool = False,
        plane: int = 0,
        digest: str = "",
        seal: Seal | None = None,
        checkpoint_key: common_pb2.DataKey | None = None,
    ) -> None:
        """`digest`: the sha256 of the manifest whose signature was checked; every agent
        refuses a manifest with other bytes. `seal`: the data key a sealed snapshot needs."""
        if len(agents) != spec.nnodes:
            raise errors.InvalidArgument(
                f"snapshot {snapshot_id} has {spec.nnodes} node(s) of ranks but "
                f"{len(agents)} node(s) were given",
                f"pass exactly {spec.nnodes} node(s) with --nodes",
            )
        self.snapshot_id = snapshot_id
        self.seal = seal
        self.checkpoint_key = checkpoint_key  # the job's, for its application checkpoints
        self.thaw_id = f"thw-{secrets.token_hex(6)}"
        self.meta = meta
        self.spec = spec
        self.agents = list(agents)
        self.resume_timeout = resume_timeout
        self.put_back_files = not fork_of_live_job
        self.plane = plane
        self.digest = digest
        self._ranks = ranks_by_node(meta, spec.nnodes)

    def run(self) -> Iterator[coordinator_pb2.ThawEvent]:
        # Node 0's rendezvous server starts while every node fetches (it imports the job's
        # torch, which takes a while).
        opened: dict[str, Any] = {}
        opener = threading.Thread(target=self._open_rdzv, args=(opened,), daemon=True)
        opener.start()
        try:
            yield from self._run(opener, opened)
        except BaseException:
            opener.join()
            job = common_pb2.JobRef(job_id=self.spec.job_id)
            call_all(self.agents[:1], "CloseRdzv", job, 30)
            raise

    def _open_rdzv(self, out: dict[str, Any]) -> None:
        try:
            out["rdzv"] = self.agents[0].stub.OpenRdzv(open_rdzv_req(self.spec), timeout=90)
        except BaseException as e:  # noqa: BLE001 - raised in the restore phase
            out["error"] = e

    def _run(
        self, opener: threading.Thread, opened: dict[str, Any]
    ) -> Iterator[coordinator_pb2.ThawEvent]:
        t0 = time.monotonic()
        node_of = {a.name: i for i, a in enumerate(self.agents)}
        ops: dict[str, str] = {}
        fetch_s: dict[str, float] = {}
        local: set[str] = set()
        failures: dict[str, BaseException] = {}
        yield pb.ThawEvent(phase=common_pb2.PhaseEvent(phase="fetch", snapshot_id=self.snapshot_id))

        def fetch(a: AgentHandle) -> agent_pb2.FetchRequest:
            streams = [r.stream for r in self._ranks[node_of[a.name]]]
            req = agent_pb2.FetchRequest(snapshot_id=self.snapshot_id, streams=streams,
                                         manifest_sha256=self.digest)  # fmt: skip
            if self.seal is not None:
                req.seal.CopyFrom(convert.data_key(self.seal))
            return req

        # Every node's stream and restore on the process's event loop, as a freeze's calls:
        # a thread per node was two per node and thaw (agents.call_all).
        for name, ev in stream_all(self.agents, "Fetch", fetch):
            if isinstance(ev, BaseException):
                failures[name] = ev
            elif ev.HasField("fetched"):
                ops[name] = ev.fetched.op
                fetch_s[name] = ev.fetched.fetch_s
                if ev.fetched.local_copy:
                    local.add(name)
            elif ev.HasField("phase"):
                ph = common_pb2.PhaseEvent()
                ph.CopyFrom(ev.phase)
                ph.node = name
                yield pb.ThawEvent(phase=ph)
            elif ev.HasField("progress"):
                p = common_pb2.TransferProgress()
                p.CopyFrom(ev.progress)
                p.node = name
                yield pb.ThawEvent(progress=p)
        if failures:
            self._discard(ops)
            raise next(iter(failures.values()))

        opener.join()
        if "error" in opened:
            self._discard(ops)
            raise opened["error"]
        yield pb.ThawEvent(phase=common_pb2.PhaseEvent(phase="restore"))
        t1 = time.monotonic()

        spec = self.spec.to_proto()

        def restore(a: AgentHandle) -> agent_pb2.RestoreRequest:
            return agent_pb2.RestoreRequest(
                op=ops[a.name], spec=spec, ranks=self._ranks[node_of[a.name]],
                node_rank=node_of[a.name], timeout_s=self.resume_timeout,
                rdzv=opened["rdzv"], epoch=self.thaw_id, put_back_files=self.put_back_files,
                plane=self.plane, seal=self.checkpoint_key,
            )  # fmt: skip

        job = common_pb2.JobRef(job_id=self.spec.job_id)

        def cancel_the_others(failed: AgentHandle, _: BaseException) -> None:
            # The other nodes' ranks would wait for the failed node's ranks until their resume
            # deadline: stop them now, so the thaw fails at once and no partial job runs.
            call_all([a for a in self.agents if a is not failed], "Cancel", job, 60)

        out = call_all(self.agents, "Restore", restore, None, first_failure=cancel_the_others)
        if out.failures:
            # Nodes that did restore must not run a partial job (again: a restore that had not
            # reached its agent when the first failure cancelled the others may have run since).
            call_all([a for a in self.agents if a.name in out.results], "Cancel", job, 60)
            self._discard(ops)
            out.raise_first()
        stats = pb.ThawStats(
            fetch_s=max(fetch_s.values(), default=0.0),
            restore_s=time.monotonic() - t1,
            total_s=time.monotonic() - t0,
            nodes=[
                pb.NodeThawStats(node=n, restore_s=r.restore_s, resume_s=r.resume_s,
                                 fetch_s=fetch_s.get(n, 0.0), local_copy=n in local)  # fmt: skip
                for n, r in out.results.items()
            ],
        )
        yield pb.ThawEvent(done=pb.ThawDone(job_id=self.spec.job_id, stats=stats))

    def _discard(self, ops: dict[str, str]) -> None:
        call_all([a for a in self.agents if a.name in ops], "DiscardFetch",
                 lambda a: agent_pb2.FetchRef(op=ops[a.name]), 60)  # fmt: skip
