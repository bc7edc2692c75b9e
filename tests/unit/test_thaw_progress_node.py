"""A thaw passes every node's fetch progress on with the node's name, whatever the agent put
there (snapshotter/coordinator/thaw.py), as a freeze does its upload progress."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from snapshotter import errors
from snapshotter.coordinator.thaw import ThawOperation
from snapshotter.launch.spec import JobSpec
from snapshotter.v1 import agent_pb2, common_pb2

pytestmark = pytest.mark.timeout(30)


class Stub:
    """An agent's stub: a fetch that reports progress without naming its node, then ends
    (or fails, on the last node, so that the thaw stops before restoring)."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.discarded: list[str] = []

    def OpenRdzv(self, req: Any, timeout: float) -> common_pb2.Endpoint:
        return common_pb2.Endpoint(host="127.0.0.1", port=29500)

    def CloseRdzv(self, req: Any, timeout: float) -> common_pb2.Empty:
        return common_pb2.Empty()

    def DiscardFetch(self, ref: agent_pb2.FetchRef, timeout: float) -> common_pb2.Empty:
        self.discarded.append(ref.op)
        return common_pb2.Empty()

    def Fetch(self, req: agent_pb2.FetchRequest) -> Iterator[agent_pb2.FetchEvent]:
        yield agent_pb2.FetchEvent(progress=common_pb2.TransferProgress(
            raw_bytes=10, total_bytes=40))  # fmt: skip
        if self.fail:
            raise errors.SnapshotCorrupt("chunk 2 fails its sha256 check", "thaw another")
        yield agent_pb2.FetchEvent(progress=common_pb2.TransferProgress(
            raw_bytes=40, total_bytes=40))  # fmt: skip
        yield agent_pb2.FetchEvent(fetched=agent_pb2.Fetched(op="thaw-1"))


class Aio:
    """The same stub as the coordinator's event-loop client sees it (rpc/aio.py's AioClient:
    a thaw's fetches, restores and discards go out on the loop)."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub

    async def call(self, method: str, req: Any, timeout: float | None) -> Any:
        return getattr(self.stub, method)(req, timeout=timeout)

    async def stream(self, method: str, req: Any, timeout: float | None = None) -> Any:
        for ev in getattr(self.stub, method)(req):
            yield ev


def _agent(name: str, stub: Stub) -> SimpleNamespace:
    return SimpleNamespace(name=name, stub=stub, aio=Aio(stub), relay=None)


def test_each_fetch_progress_names_its_node() -> None:
    spec = JobSpec("job-a", "train.py", [], False, "python3", "/", {}, nnodes=2)
    meta = {"ranks": [{"rank": 0, "node_rank": 0, "stream": "rank-0"},
                      {"rank": 1, "node_rank": 1, "stream": "rank-1"}]}  # fmt: skip
    agents = [_agent("a", Stub(False)), _agent("b", Stub(True))]
    events = []
    with pytest.raises(errors.SnapshotCorrupt):
        for ev in ThawOperation("job-a-0001", meta, spec, agents).run():  # type: ignore[arg-type]
            events.append(ev)
    progress = [(e.progress.node, e.progress.raw_bytes) for e in events if e.HasField("progress")]
    assert sorted(progress) == [("a", 10), ("a", 40), ("b", 10)]
    assert all(e.progress.total_bytes == 40 for e in events if e.HasField("progress"))
    assert agents[0].stub.discarded == ["thaw-1"]  # the node that fetched drops it again
