"""Cluster audit's pure decisions: the probe schedule, and what is named degraded or failed
against the cluster's own median."""

from __future__ import annotations

import itertools

import pytest

from snapshotter.coordinator import audit_rules as rules
from snapshotter.coordinator.audit_rules import Check, Probe


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16])
def test_every_pair_once_in_about_n_rounds_no_node_twice_a_round(n: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    schedule = rules.rounds(nodes)
    assert len(schedule) == (n - 1 if n % 2 == 0 else n)
    seen = [frozenset(p) for r in schedule for p in r]
    assert sorted(map(sorted, seen)) == sorted(map(sorted, itertools.combinations(nodes, 2)))
    for r in schedule:
        in_round = [x for p in r for x in p]
        assert len(in_round) == len(set(in_round)), r
    probing = [a for r in schedule for a, _ in r]
    assert max(probing.count(x) for x in nodes) - min(probing.count(x) for x in nodes) <= 2


def test_one_node_is_no_pair() -> None:
    assert rules.rounds(["a"]) == [] and rules.rounds([]) == []


def _mesh(slow: dict[str, float], retrans: dict[str, float] | None = None,
          nodes: str = "abcd") -> list[Probe]:  # fmt: skip
    """Every pair on plane 0: 100 MB/s, 0.2 ms, unless a node's interface is slower."""
    out = []
    for a, b in itertools.combinations(nodes, 2):
        mbps = min(slow.get(a, 100.0), slow.get(b, 100.0))
        r = max((retrans or {}).get(a, 0.0), (retrans or {}).get(b, 0.0))
        out.append(Probe(a, b, 0, 0.2, mbps, r))
    return out


def _judged(probes: list[Probe]) -> dict[str, rules.Verdict]:
    refs = rules.references(rules.ports(probes))
    judged = [(p, rules.judge_link(p.rtt_ms, p.mbps, p.retrans, [p.error] if p.error else [],
                                   *refs[p.plane], all_failed=bool(p.error)))
              for p in probes]  # fmt: skip
    return {node: v for (node, _), v in rules.blame(judged).items()}


def test_a_slow_interface_is_named_and_its_peers_are_not() -> None:
    v = _judged(_mesh({"b": 2.5}))
    assert {n: x.status for n, x in v.items()} == {
        "a": "healthy", "b": "failed", "c": "healthy", "d": "healthy"}
    assert "throughput 2.5 MB/s" in v["b"].why[0] and v["b"].why[0].startswith("with a: ")
    v = _judged(_mesh({"b": 40.0}))
    assert v["b"].status == "degraded" and v["a"].status == "healthy"
    # Three nodes: the slow one still stands out against the median of the interfaces.
    v = _judged(_mesh({"b": 2.5}, nodes="abc"))
    assert [n for n, x in v.items() if x.status != "healthy"] == ["b"]


def test_retransmissions_and_errors() -> None:
    v = _judged(_mesh({}, {"c": 0.03}))
    assert v["c"].status == "degraded" and "3.0% of segments" in v["c"].why[0]
    assert [n for n, x in v.items() if x.status != "healthy"] == ["c"]
    v = _judged(_mesh({}, {"c": 0.2}))
    assert v["c"].status == "failed"
    probes = [p if "d" not in (p.a, p.b) else Probe(p.a, p.b, 0, 0, 0, 0, "refused")
              for p in _mesh({})]  # fmt: skip
    v = _judged(probes)
    assert {n: x.status for n, x in v.items()} == {
        "a": "healthy", "b": "healthy", "c": "healthy", "d": "failed"}


def test_two_nodes_name_both_ends_and_one_noisy_pair_names_its_two() -> None:
    v = _judged([Probe("a", "b", 0, 0.2, 100, 0.05)])
    assert {n: x.status for n, x in v.items()} == {"a": "degraded", "b": "degraded"}
    probes = [p if {p.a, p.b} != {"a", "c"} else Probe("a", "c", 0, 0.2, 10, 0)
              for p in _mesh({})]  # fmt: skip
    v = _judged(probes)
    assert sorted(n for n, x in v.items() if x.status != "healthy") == ["a", "c"]


def test_latency_far_over_the_median() -> None:
    probes = [Probe(p.a, p.b, 0, 5.0 if "a" in (p.a, p.b) else 0.2, p.mbps, 0)
              for p in _mesh({})]  # fmt: skip
    v = _judged(probes)
    assert v["a"].status == "degraded" and "latency 5.00 ms" in v["a"].why[0]
    assert v["b"].status == "healthy"


def test_nodes_failed_checks_slow_storage_and_silence() -> None:
    def storage(mbps: float) -> list[Check]:
        return [Check("criu", "ok"), Check("storage_write", "ok", mbps, True),
                Check("gpus", "skipped")]  # fmt: skip

    checks = {"a": storage(200), "b": storage(210), "c": storage(40),
              "d": [Check("criu", "ok"), Check("storage", "failed", detail="connection refused")]}
    v = rules.judge_nodes(checks, {"e": "deadline exceeded"})
    assert {n: x.status for n, x in v.items()} == {
        "a": "healthy", "b": "healthy", "c": "degraded", "d": "failed", "e": "failed"}
    assert v["d"].why == ["storage: connection refused"]
    assert "did not answer" in v["e"].why[0]
