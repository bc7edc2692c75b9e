"""Fan-outs through relays (rpc/relay.py) between real agents serving gRPC with mutual TLS on
127.0.0.1: a real freeze whose control phases each node receives from a relay, and the
orders a node must refuse from another node (forged, altered, addressed to another node,
replayed, of a method not relayed, from behind the fence), each refused before it runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from snapshotter import errors, metrics
from snapshotter.coordinator import agents
from snapshotter.coordinator.agents import AgentHandle, call_all
from snapshotter.rpc import relay
from snapshotter.rpc.aio import LOOP, AioClient
from snapshotter.rpc.client import Target, agent_client
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from snapshotter.v1 import coordinator_pb2 as pb
from tests.support.agents import ROOT, Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("relay")
    c = Cluster(tmp, ("a", "b", "c"), ROOT / "examples" / "train_ddp.py", tcp=True)
    try:
        yield c
    finally:
        c.close()


def _count(method: str, code: str = "ok") -> float:
    v = metrics.AGENT.get_sample_value("snapshotter_rpc_seconds_count",
                                       {"method": method, "code": code})  # fmt: skip
    return v or 0.0


def _as_node(c: Cluster, node: str, to: str) -> object:
    """The Agent stub of node `to`, called with node `node`'s certificate (as a relay)."""
    tls = TlsFiles.in_dir(c.tmp / "tls", f"nodes/{node}")
    return agent_client(Target(c.address[to], tls=tls, server_name=to)).stub


def _order(c: Cluster, method: str, request: object, targets: list[str],
           timeout: float = 10.0, fence: str = "") -> agent_pb2.RelayedCall:  # fmt: skip
    raw = request.SerializeToString()  # type: ignore[attr-defined]
    order, sig = c.coord.relay.sign(method, raw, timeout, fence, targets)
    return agent_pb2.RelayedCall(order=order, signature=sig)


def test_a_freeze_reaches_every_node_through_a_relay_and_the_job_goes_on(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", "1")  # relay even a one-node fan-out
    job = cluster.run("relayed", "a", "--steps", "60", "--step-sleep", "0.05")
    relayed0, relay0 = _count("Relayed"), _count("Relay")
    events = list(cluster.coord.freeze(pb.FreezeRequest(job_id=job)))
    done = [e.done for e in events if e.HasField("done")]
    assert done and done[0].snapshot_id, events[-3:]
    # prepare, park, suspend, resume and finish: each one Relay to a, which delivered it to
    # itself over TLS as a Relayed call; the calls they carried ran and answered.
    assert _count("Relay") - relay0 == 5
    assert _count("Relayed") - relayed0 == 5
    result = cluster.wait(job)
    assert result["steps"] == 60


def test_a_fan_out_over_relays_answers_as_direct_calls_do(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = cluster.coord.live_agents()
    handles = [live[n] for n in ("a", "b", "c")]
    ref = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", "0")
    direct = call_all(handles, "Resume", ref, 10)
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", "2")
    relayed0 = _count("Relayed")
    via = call_all(handles, "Resume", ref, 10)
    assert _count("Relayed") - relayed0 == 3  # a relayed to a and b, c to itself (groups of 2)
    assert list(via.failures) == list(direct.failures) == ["a", "b", "c"]
    for n in ("a", "b", "c"):
        got, want = via.failures[n], direct.failures[n]
        assert type(got) is type(want) and got.cause == want.cause, (got, want)


def test_a_node_that_has_not_learnt_the_key_is_called_directly(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = cluster.coord.live_agents()
    handles: list[AgentHandle] = [live["a"], live["b"]]
    trust = cluster.trust["b"]
    monkeypatch.setattr(trust, "_key", None)  # as before b's first heartbeat reply
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", "2")
    refused0 = _count("Relayed", "unauthenticated")
    ref = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    out = call_all(handles, "Resume", ref, 10)
    assert _count("Relayed", "unauthenticated") - refused0 == 1
    # b still answered: the coordinator's own call, after the relay reported it undelivered.
    assert sorted(out.failures) == ["a", "b"]
    assert isinstance(out.failures["b"], errors.JobNotFound), out.failures["b"]


def test_a_node_refuses_what_its_coordinator_did_not_sign_for_it(cluster: Cluster) -> None:
    b_to_a = _as_node(cluster, "b", "a")
    req = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    good = _order(cluster, "Resume", req, ["a"])

    # Signed by another key (a relay's own, say): refused.
    forged_order, forged_sig = relay.Signer().sign("Resume", req.SerializeToString(), 10, "",
                                                   ["a"])  # fmt: skip
    with pytest.raises(errors.Unauthenticated, match="not signed by this node's coordinator"):
        b_to_a.Relayed(agent_pb2.RelayedCall(order=forged_order, signature=forged_sig),
                       timeout=10)  # fmt: skip
    # The coordinator's order with one byte changed: refused.
    altered = bytearray(good.order)
    altered[-1] ^= 1
    with pytest.raises(errors.Unauthenticated):
        b_to_a.Relayed(agent_pb2.RelayedCall(order=bytes(altered), signature=good.signature),
                       timeout=10)  # fmt: skip
    # Addressed to c only: a refuses it.
    with pytest.raises(errors.PermissionDenied, match="not addressed to node a"):
        b_to_a.Relayed(_order(cluster, "Resume", req, ["c"]), timeout=10)
    # A method the coordinator signed but that is never relayed (Cancel): refused.
    with pytest.raises(errors.PermissionDenied, match="may not be relayed"):
        b_to_a.Relayed(_order(cluster, "Cancel", common_pb2.JobRef(job_id="x"), ["a"]),
                       timeout=10)  # fmt: skip

    # The good order runs once (the job is unknown: that is its answer), then is a replay.
    rep = b_to_a.Relayed(good, timeout=10)
    assert rep.HasField("error") and rep.error.code == errors.JobNotFound.code, rep
    with pytest.raises(errors.InvalidArgument, match="delivered twice"):
        b_to_a.Relayed(good, timeout=10)


def test_a_relayed_call_passes_the_fence_as_a_direct_one(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    fence = cluster.fences["c"]
    monkeypatch.setattr(fence, "_highest", None)  # put back after: the cluster's coordinator
    fence.check("7:newer")  # a newer coordinator has talked to c
    b_to_c = _as_node(cluster, "b", "c")
    req = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    old = b_to_c.Relayed(_order(cluster, "Resume", req, ["c"], fence="3:older"), timeout=10)
    assert old.error.code == errors.Fenced.code, old
    unfenced = b_to_c.Relayed(_order(cluster, "Resume", req, ["c"]), timeout=10)
    assert unfenced.error.code == errors.Fenced.code, unfenced
    current = b_to_c.Relayed(_order(cluster, "Resume", req, ["c"], fence="7:newer"), timeout=10)
    assert current.error.code == errors.JobNotFound.code, current


def test_only_the_coordinator_may_ask_a_node_to_relay(cluster: Cluster) -> None:
    b_to_a = _as_node(cluster, "b", "a")
    req = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    call = _order(cluster, "Resume", req, ["a"])
    with pytest.raises(errors.PermissionDenied, match="DRIVE"):
        b_to_a.Relay(agent_pb2.RelayRequest(order=call.order, signature=call.signature,
                                            targets=[agent_pb2.RelayTarget(
                                                name="a", address=cluster.address["a"])]),
                     timeout=10)  # fmt: skip



def test_a_node_may_carry_relayed_calls_on_control_but_nothing_it_may_not_call(
    cluster: Cluster,
) -> None:
    tls = TlsFiles.in_dir(cluster.tmp / "tls", "nodes/b")
    b_to_a = AioClient(Target(cluster.address["a"], tls=tls, server_name="a"),
                       agent_pb2_grpc.AgentStub, "agent", "agent",
                       agent_pb2.DESCRIPTOR.services_by_name["Agent"])  # fmt: skip
    try:
        req = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
        rep = LOOP.run(b_to_a.call("Relayed", _order(cluster, "Resume", req, ["a"]), 10))
        assert rep.error.code == errors.JobNotFound.code, rep
        # It rode a Control stream the node's certificate opened (not a call of its own).
        assert b_to_a._control is not None and b_to_a._control._stream is not None
        # The same stream, a call that needs DRIVE: refused, by its own right.
        with pytest.raises(errors.PermissionDenied, match="DRIVE"):
            LOOP.run(b_to_a.call("Cancel", common_pb2.JobRef(job_id="x"), 10))
    finally:
        b_to_a.close()


def test_a_failed_relay_has_its_group_called_directly_and_another_member_relays_next(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = cluster.coord.live_agents()
    handles = [live["a"], live["b"]]
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", "2")
    monkeypatch.setattr(agents, "_SUSPECT", {})
    ref = agent_pb2.PhaseRequest(job_id="no-such-job", freeze_id="frz-none", timeout_s=5)
    real = relay.Relayer.relay

    def broken(self: relay.Relayer, req: agent_pb2.RelayRequest) -> agent_pb2.RelayReply:
        raise errors.Internal("the relay broke", "see its log")

    monkeypatch.setattr(relay.Relayer, "relay", broken)
    failed0, direct0 = _count("Relay", "internal"), _count("Resume", "job_not_found")
    out = call_all(handles, "Resume", ref, 10)
    # a's Relay failed; a and b were each called directly, and answered as themselves.
    assert _count("Relay", "internal") - failed0 == 1
    assert _count("Resume", "job_not_found") - direct0 == 2
    assert sorted(out.failures) == ["a", "b"]
    assert all(isinstance(e, errors.JobNotFound) for e in out.failures.values()), out.failures
    # Next, b relays for the group (a is suspect for a while), and the calls go through it.
    monkeypatch.setattr(relay.Relayer, "relay", real)
    heads: list[str] = []
    choose = agents._head

    def spy(members: list[AgentHandle]) -> AgentHandle:
        heads.append(choose(members).name)
        return choose(members)

    monkeypatch.setattr(agents, "_head", spy)
    ok0, relayed0 = _count("Relay"), _count("Relayed")
    out = call_all(handles, "Resume", ref, 10)
    assert heads == ["b"]
    assert _count("Relay") - ok0 == 1 and _count("Relayed") - relayed0 == 2
    assert sorted(out.failures) == ["a", "b"]
