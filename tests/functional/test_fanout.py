"""The coordinator's fan-outs on its event loop (`call_all`, `stream_all`, rpc/aio.py) against
real agents serving gRPC with mutual TLS on 127.0.0.1: answers by node, and every failure as
the same typed error the blocking client raises, naming the node's address and the call."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.coordinator.agents import AgentHandle, call_all, stream_all
from snapshotter.v1 import common_pb2
from tests.support.agents import ROOT, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("fanout")
    c = Cluster(tmp, ("a", "b"), ROOT / "examples" / "train_ddp.py", tcp=True)
    try:
        yield c
    finally:
        c.close()


def _handles(c: Cluster) -> list[AgentHandle]:
    live = c.coord.live_agents()
    return [live["a"], live["b"]]


def test_a_call_on_every_agent_answers_by_node_over_tls(cluster: Cluster) -> None:
    out = call_all(_handles(cluster), "Ping", common_pb2.Empty(), 10)
    assert out.ok, out.failures
    assert list(out.results) == ["a", "b"]
    assert {k: r.node for k, r in out.results.items()} == {"a": "a", "b": "b"}


def test_an_agents_refusal_arrives_as_the_blocking_clients_error(cluster: Cluster) -> None:
    handles = _handles(cluster)
    ref = common_pb2.JobRef(job_id="no-such-job")
    out = call_all(handles, "Status", ref, 10)
    assert not out.results and list(out.failures) == ["a", "b"]
    with pytest.raises(errors.SnapshotterError) as blocking:
        handles[0].stub.Status(ref, timeout=10)
    got = out.failures["a"]
    assert type(got) is type(blocking.value) and got.cause == blocking.value.cause, got


def test_one_node_gone_or_impostor_fails_alone_naming_why(cluster: Cluster, tmp_path: Path) -> None:
    good = _handles(cluster)[0]
    nowhere = f"unix:{tmp_path / 'none.sock'}"
    b = cluster.address["b"]
    gone = AgentHandle("gone", nowhere, "127.0.0.1",
                       dataclasses.replace(good.target, address=nowhere))
    # b's address, but the certificate must carry a's name: TLS refuses it.
    impostor = AgentHandle("impostor", b, "127.0.0.1", dataclasses.replace(good.target, address=b))
    try:
        out = call_all([good, gone, impostor], "Ping", common_pb2.Empty(), 10)
    finally:
        gone.close()
        impostor.close()
    assert list(out.results) == ["a"]
    assert isinstance(out.failures["gone"], errors.ServiceUnavailable)
    assert "none.sock" in out.failures["gone"].cause and "Ping" in out.failures["gone"].cause
    assert isinstance(out.failures["impostor"], errors.ServiceUnavailable)
    assert "TLS handshake" in out.failures["impostor"].cause, out.failures["impostor"]


def test_hooks_see_every_call_start_and_end(cluster: Cluster) -> None:
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def started(a: AgentHandle) -> None:
        with lock:
            seen.append(("start", a.name))

    def ended(a: AgentHandle, t0: float, t1: float) -> None:
        assert t1 >= t0
        with lock:
            seen.append(("end", a.name))

    call_all(_handles(cluster), "Ping", common_pb2.Empty(), 10, started=started, ended=ended)
    assert sorted(seen) == [("end", "a"), ("end", "b"), ("start", "a"), ("start", "b")]


def test_streams_from_every_agent_merge_and_a_failure_stays_its_nodes(cluster: Cluster) -> None:
    job = cluster.run("fan-logs", "a", "--steps", "3")
    cluster.wait(job)
    handles = _handles(cluster)
    req = common_pb2.LogsRequest(job_id=job)
    got: dict[str, list[object]] = {"a": [], "b": []}
    for name, msg in stream_all(handles, "Logs", req):
        got[name].append(msg)
    chunks = [m for m in got["a"] if not isinstance(m, BaseException)]
    assert chunks and all(isinstance(m, common_pb2.LogChunk) for m in chunks), got["a"]
    # Node b never ran the job: its stream fails, as the blocking client's would.
    assert len(got["b"]) == 1 and isinstance(got["b"][0], errors.SnapshotterError), got["b"]
    with pytest.raises(errors.SnapshotterError) as blocking:
        list(handles[1].stub.Logs(req))
    assert type(got["b"][0]) is type(blocking.value)


def test_first_failure_runs_once_off_the_loop_and_before_call_all_returns(
    cluster: Cluster, tmp_path: Path
) -> None:
    good = _handles(cluster)
    gone = [
        AgentHandle(n, f"unix:{tmp_path / n}.sock", "127.0.0.1",
                    dataclasses.replace(good[0].target, address=f"unix:{tmp_path / n}.sock"))
        for n in ("gone1", "gone2")
    ]  # fmt: skip
    hooked: list[tuple[str, str, bool]] = []
    finished = threading.Event()

    def first_failure(a: AgentHandle, e: BaseException) -> None:
        # It may block (a thaw cancels the other nodes here): a blocking fan-out of its own
        # must work from it, which it could not on the loop's thread.
        pinged = call_all(good, "Ping", common_pb2.Empty(), 10)
        hooked.append((a.name, type(e).__name__, pinged.ok))
        finished.set()

    try:
        out = call_all([*good, *gone], "Ping", common_pb2.Empty(), 10, first_failure=first_failure)
    finally:
        for g in gone:
            g.close()
    assert finished.is_set(), "call_all returned before its first_failure hook ended"
    assert len(hooked) == 1, hooked
    name, kind, pinged_ok = hooked[0]
    assert name in ("gone1", "gone2") and kind == "ServiceUnavailable" and pinged_ok, hooked
    assert list(out.results) == ["a", "b"] and sorted(out.failures) == ["gone1", "gone2"]


def test_no_failure_no_hook_and_each_agent_gets_its_own_stream_request(cluster: Cluster) -> None:
    called: list[str] = []
    out = call_all(_handles(cluster), "Ping", common_pb2.Empty(), 10,
                   first_failure=lambda a, e: called.append(a.name))  # fmt: skip
    assert out.ok and not called, (out.failures, called)

    job = cluster.run("fan-own", "a", "--steps", "2")
    cluster.wait(job)
    asked = {"a": job, "b": "fan-nobody"}
    got: dict[str, list[object]] = {"a": [], "b": []}
    def logs(h: AgentHandle) -> common_pb2.LogsRequest:
        return common_pb2.LogsRequest(job_id=asked[h.name])

    for name, msg in stream_all(_handles(cluster), "Logs", logs):
        got[name].append(msg)
    assert got["a"] and not any(isinstance(m, BaseException) for m in got["a"]), got["a"]
    assert len(got["b"]) == 1 and isinstance(got["b"][0], errors.JobNotFound), got["b"]
    assert "fan-nobody" in got["b"][0].cause, got["b"][0]
