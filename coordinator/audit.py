"""Cluster audit (`snapshotter audit`): every node checks itself, and every node pair probes
each data link between them, in rounds in which no node is in two probes (audit_rules.rounds:
N nodes take about N rounds per plane, not N² probes' time). Each result is then judged
against the cluster's own median (audit_rules, pure) into healthy / degraded / failed.

A probe: the listener's agent opens a one-connection listener on its address of that plane
(OpenProbe, a fresh token), the prober's agent connects from its own address of the plane
and measures latency, throughput and retransmissions (ProbeLink; agent/probe.py).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

from snapshotter import errors
from snapshotter.coordinator import audit_rules as rules
from snapshotter.coordinator.agents import AgentHandle, call_all
from snapshotter.rpc.aio import LOOP
from snapshotter.v1 import agent_pb2, common_pb2
from snapshotter.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator

DEFAULT_LINK_BYTES = 32 << 20
DEFAULT_STORAGE_BYTES = 8 << 20
MAX_BYTES = 1 << 30


def _bounded(v: int, default: int, what: str) -> int:
    if v < 0 or v > MAX_BYTES:
        raise errors.InvalidArgument(f"{what} of {v} bytes is out of range",
                                     f"pass 1 byte .. {MAX_BYTES >> 20} MiB")  # fmt: skip
    return v or default


async def _probe(a: AgentHandle, b: AgentHandle, plane: int, nbytes: int) -> rules.Probe:
    """`a` measures its link to `b` on `plane`; a failure to set it up is the probe's error."""
    try:
        token = secrets.token_hex(16)
        ep = await b.aio.call("OpenProbe", agent_pb2.OpenProbeRequest(
            plane=plane, token=token, peer=a.name), 30)  # fmt: skip
        m = await a.aio.call("ProbeLink", agent_pb2.ProbeLinkRequest(
            peer=b.name, address=ep.address, port=ep.port, token=token, bytes=nbytes,
            plane=plane), 180)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the link's outcome
        return rules.Probe(a.name, b.name, plane, 0.0, 0.0, 0.0, _cause(e))
    return rules.Probe(a.name, b.name, plane, m.rtt_ms, m.mbps, m.retrans, m.error)


def _round(live: dict[str, AgentHandle], plane: int, nbytes: int,
           pairs: list[tuple[str, str]]) -> list[rules.Probe]:  # fmt: skip
    """One round's probes at once, on the process's event loop (a thread per pair was half
    as many threads as nodes, every round)."""

    async def every() -> list[rules.Probe]:
        return await asyncio.gather(*(_probe(live[a], live[b], plane, nbytes) for a, b in pairs))

    return LOOP.run(every())


def _cause(e: BaseException) -> str:
    return e.cause if isinstance(e, errors.SnapshotterError) else f"{type(e).__name__}: {e}"


def run(c: Coordinator, req: pb.AuditRequest) -> pb.AuditReport:
    """Raises: InvalidArgument for a node that is not a live agent, or bad sizes."""
    started = time.monotonic()
    live = c.live_agents()
    names = list(dict.fromkeys(req.nodes)) or sorted(live)
    unknown = [n for n in names if n not in live]
    if unknown or not names:
        raise errors.InvalidArgument(
            f"no live agent named {', '.join(unknown)}" if unknown else "no agent has registered",
            "see `snapshotter nodes`",
        )
    link_bytes = _bounded(req.link_bytes, DEFAULT_LINK_BYTES, "a link probe")
    storage_bytes = _bounded(req.storage_bytes, DEFAULT_STORAGE_BYTES, "a storage probe")
    agents = [live[n] for n in names]

    asked = call_all(agents, "AuditNode",
                     agent_pb2.AuditNodeRequest(storage_bytes=storage_bytes), 240)  # fmt: skip
    checks = {n: list(r.checks) for n, r in asked.results.items()}
    unreachable = {n: _cause(e) for n, e in asked.failures.items()}

    schedule = rules.rounds([n for n in names if n not in unreachable])
    planes = min((max(1, len(a.links)) for a in agents), default=1)
    probes: list[rules.Probe] = []
    for plane in range(planes):
        for pairs in schedule:
            probes += _round(live, plane, link_bytes, list(pairs))
    return _report(checks, unreachable, probes, len(schedule) * planes,
                   time.monotonic() - started)  # fmt: skip


def _report(
    got: dict[str, list[common_pb2.AuditCheck]],
    unreachable: dict[str, str],
    probes: list[rules.Probe],
    n_rounds: int,
    seconds: float,
) -> pb.AuditReport:
    verdicts = rules.judge_nodes(
        {n: [rules.Check(c.name, c.status, c.value, c.higher_is_better, c.detail) for c in cs]
         for n, cs in got.items()}, unreachable)  # fmt: skip
    report = pb.AuditReport(rounds=n_rounds, seconds=seconds)
    for n in sorted(verdicts):
        v = verdicts[n]
        report.nodes.add(node=n, status=v.status, checks=got.get(n, []), why=v.why)
    ports = rules.ports(probes)
    refs = rules.references(ports)
    judged = []
    for p in probes:
        v = rules.judge_link(p.rtt_ms, p.mbps, p.retrans, [p.error] if p.error else [],
                             *refs[p.plane], all_failed=bool(p.error))  # fmt: skip
        judged.append((p, v))
        report.links.add(a=p.a, b=p.b, plane=p.plane, rtt_ms=p.rtt_ms, mbps=p.mbps,
                         retrans=p.retrans, status=v.status, why=v.why)  # fmt: skip
    blamed = rules.blame(judged)
    for x in ports:
        v = blamed[(x.node, x.plane)]
        report.interfaces.add(node=x.node, plane=x.plane, rtt_ms=x.rtt_ms, mbps=x.mbps,
                              retrans=x.retrans, status=v.status, why=v.why)  # fmt: skip
    report.passed = all(n.status == rules.HEALTHY for n in report.nodes) and all(
        i.status == rules.HEALTHY for i in report.interfaces)
    return report
