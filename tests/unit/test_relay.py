"""The relay's decisions (rpc/relay.py): how a fan-out is cut into groups, and what a node
accepts from a relay: only an order its coordinator's key signed, for it, once, in time."""

from __future__ import annotations

import asyncio

import pytest

from snapshotter import errors
from snapshotter.rpc import relay
from snapshotter.v1 import agent_pb2, common_pb2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 256, 512, 2048, 16384])
def test_groups_cover_every_node_once_in_about_sqrt_n_groups_of_about_sqrt_n(n: int) -> None:
    gs = relay.groups(n)
    assert [i for g in gs for i in g] == list(range(n))
    size = max(len(g) for g in gs)
    # Both the coordinator's messages (one per group) and a relay's (one per member) stay
    # within a small step of sqrt(n).
    assert len(gs) <= n**0.5 + 2 and size <= n**0.5 + 2, (len(gs), size)
    assert all(len(g) >= 1 for g in gs)


def test_no_nodes_no_groups() -> None:
    assert relay.groups(0) == []


@pytest.mark.parametrize(("raw", "want"), [("", relay.DEFAULT_MIN_AGENTS), ("2", 2),
                                           ("0", 1 << 62), ("junk", relay.DEFAULT_MIN_AGENTS)])
def test_the_smallest_relayed_fan_out_comes_from_the_environment(
    raw: str, want: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SNAPSHOTTER_RELAY_MIN", raw)
    assert relay.min_agents() == want


@pytest.fixture()
def signer() -> relay.Signer:
    return relay.Signer()


def _trust(signer: relay.Signer, name: str = "n1") -> relay.Trust:
    t = relay.Trust(name)
    t.learn(signer.public)
    return t


def test_a_signed_order_for_this_node_is_admitted_with_what_it_carries(
    signer: relay.Signer,
) -> None:
    req = agent_pb2.PhaseRequest(job_id="j", freeze_id="f", timeout_s=3)
    order, sig = signer.sign("Park", req.SerializeToString(), 30, "4:abc", ["n0", "n1"])
    o = _trust(signer).admit(order, sig)
    assert (o.method, o.fence, list(o.targets)) == ("Park", "4:abc", ["n0", "n1"])
    assert agent_pb2.PhaseRequest.FromString(o.request) == req
    assert o.timeout_s == 30


def test_without_a_key_nothing_is_admitted(signer: relay.Signer) -> None:
    order, sig = signer.sign("Park", b"", 30, "", ["n1"])
    with pytest.raises(errors.Unauthenticated, match="no relay key"):
        relay.Trust("n1").admit(order, sig)


def test_another_key_or_an_altered_order_is_refused(signer: relay.Signer) -> None:
    trust = _trust(signer)
    order, sig = relay.Signer().sign("Park", b"", 30, "", ["n1"])
    with pytest.raises(errors.Unauthenticated):
        trust.admit(order, sig)
    order, sig = signer.sign("Park", b"", 30, "", ["n1"])
    altered = bytearray(order)
    altered[2] ^= 0x40
    with pytest.raises(errors.Unauthenticated):
        trust.admit(bytes(altered), sig)


def test_a_new_coordinators_key_replaces_the_old_one(signer: relay.Signer) -> None:
    trust = _trust(signer)
    newer = relay.Signer()
    trust.learn(newer.public)
    with pytest.raises(errors.Unauthenticated):
        trust.admit(*signer.sign("Park", b"", 30, "", ["n1"]))
    assert trust.admit(*newer.sign("Park", b"", 30, "", ["n1"])).method == "Park"


def test_an_order_for_other_nodes_or_of_a_method_not_relayed_is_refused(
    signer: relay.Signer,
) -> None:
    trust = _trust(signer)
    with pytest.raises(errors.PermissionDenied, match="not addressed to node n1"):
        trust.admit(*signer.sign("Park", b"", 30, "", ["n0", "n2"]))
    for method in ("Cancel", "Launch", "Restore", "Dump", "Abort"):
        with pytest.raises(errors.PermissionDenied, match="may not be relayed"):
            trust.admit(*signer.sign(method, b"", 30, "", ["n1"]))


def test_an_order_runs_once_and_not_after_it_expired(signer: relay.Signer) -> None:
    trust = _trust(signer)
    order, sig = signer.sign("Suspend", b"", 30, "", ["n1"], now=1000.0)
    assert trust.admit(order, sig, now=1001.0).method == "Suspend"
    with pytest.raises(errors.InvalidArgument, match="delivered twice"):
        trust.admit(order, sig, now=1002.0)
    late = signer.sign("Suspend", b"", 30, "", ["n1"], now=1000.0)
    with pytest.raises(errors.InvalidArgument, match="expired"):
        trust.admit(*late, now=1000.0 + 30 + relay.SLACK_S + 1)
    # One claiming to stay valid longer than any order may is refused too (it would pin its
    # nonce in memory).
    ahead = signer.sign("Suspend", b"", 30, "", ["n1"], now=1000.0 + 2 * relay.MAX_VALID_S)
    with pytest.raises(errors.InvalidArgument):
        trust.admit(*ahead, now=1000.0)


def test_nonces_are_forgotten_once_their_orders_expired(signer: relay.Signer) -> None:
    trust = _trust(signer)
    for i in range(1100):
        trust.admit(*signer.sign("Park", b"", 1, "", ["n1"], now=float(i)), now=float(i))
    # Those that expired were dropped on the way: memory stays bounded by the orders alive.
    assert len(trust._seen) <= 1100 - 900


def test_a_malformed_key_is_refused_when_learnt() -> None:
    with pytest.raises(ValueError):
        relay.Trust("n1").learn(b"short")


def test_a_relay_reports_each_target_delivered_or_not() -> None:
    req = agent_pb2.RelayRequest(order=b"o", signature=b"s", targets=[
        agent_pb2.RelayTarget(name=n, address=f"unix:/{n}") for n in ("ok", "bad", "gone")])

    async def call(t: agent_pb2.RelayTarget, relayed: agent_pb2.RelayedCall,
                   timeout: float) -> agent_pb2.ControlReply:  # fmt: skip
        assert (relayed.order, relayed.signature, timeout) == (b"o", b"s", 7.0)
        if t.name == "gone":
            raise errors.ServiceUnavailable("cannot reach unix:/gone", "retry")
        if t.name == "bad":
            return agent_pb2.ControlReply(error=common_pb2.ErrorDetail(code="job_not_found"))
        return agent_pb2.ControlReply(reply=b"r")

    rep = asyncio.run(relay.deliver(req, call, 7.0))
    by = {r.name: r for r in rep.results}
    assert [r.name for r in rep.results] == ["ok", "bad", "gone"]
    assert by["ok"].delivered and by["ok"].reply == b"r"
    assert by["bad"].delivered and by["bad"].error.code == "job_not_found"
    assert not by["gone"].delivered and by["gone"].error.code == "service_unavailable"
    assert "unix:/gone" in by["gone"].error.cause


def test_a_relay_keeps_few_clients_and_closes_the_oldest_and_the_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    r = relay.Relayer(None)
    monkeypatch.setattr(r, "MAX_CLIENTS", 2)
    now = [1000.0]
    monkeypatch.setattr(relay.time, "monotonic", lambda: now[0])
    t = [agent_pb2.RelayTarget(name=f"n{i}", address=f"unix:/n{i}") for i in range(4)]
    c0, c1 = r._client(t[0]), r._client(t[1])
    assert r._client(t[0]) is c0  # kept, and now the most recently used
    c2 = r._client(t[2])  # past the bound: the least recently used (n1) is closed
    assert c1._closed and not c0._closed and not c2._closed
    assert set(r._clients) == {("n0", "unix:/n0"), ("n2", "unix:/n2")}
    now[0] += relay.Relayer.IDLE_S + 1
    c3 = r._client(t[3])  # both others idle too long: closed
    assert c0._closed and c2._closed and not c3._closed
    assert list(r._clients) == [("n3", "unix:/n3")]
    r.close()
    assert c3._closed and not r._clients
