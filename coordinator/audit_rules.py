"""Cluster audit's decisions (pure): which node pairs probe each other in which round, and
what is healthy, degraded or failed against the cluster's own median.

Rounds: every pair once, no node in two pairs of a round (the circle method), so N nodes take
N-1 rounds (N if odd) however many pairs there are, and each round's probes share no node.

A link is judged per interface (a node's port on one plane), not per pair: a slow cable shows
in every pair that crosses it. Each pair is judged against its plane's reference: the median
over the plane's interfaces of each one's median over its pairs, so fewer than half of them
bad cannot move it. The bad pairs are then blamed on the interfaces they share most
(`blame`). With two nodes the two interfaces share their one pair: both are named.

    status:  healthy ──value past DEGRADED_*──▶ degraded ──past FAILED_* or an error──▶ failed
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

HEALTHY, DEGRADED, FAILED = "healthy", "degraded", "failed"
_ORDER = {HEALTHY: 0, DEGRADED: 1, FAILED: 2}

# Throughput (links, storage): below these fractions of the median.
DEGRADED_BELOW = 0.5
FAILED_BELOW = 0.1
# Latency: above this many times the median and this much more (sub-ms noise is no fault).
RTT_FACTOR = 3.0
RTT_FLOOR_MS = 1.0
# Retransmitted segments per segment sent: absolute (a healthy link retransmits ~nothing).
RETRANS_DEGRADED = 0.01
RETRANS_FAILED = 0.1


def rounds(nodes: Sequence[str]) -> list[list[tuple[str, str]]]:
    """Every unordered pair of `nodes` once, as (prober, listener), in rounds in which no node
    appears twice. Directions alternate so each node probes about as often as it listens."""
    ring: list[str | None] = list(nodes)
    if len(ring) < 2:
        return []
    if len(ring) % 2:
        ring.append(None)  # a bye
    n = len(ring)
    out = []
    for r in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = ring[i], ring[n - 1 - i]
            if a is not None and b is not None:
                # A node other than the first moves one place a round, so it spends about
                # half the rounds on each side; the first alternates.
                pairs.append((b, a) if i == 0 and r % 2 else (a, b))
        out.append(pairs)
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


@dataclass
class Verdict:
    status: str = HEALTHY
    why: list[str] = field(default_factory=list)

    def worse(self, status: str, why: str) -> None:
        if _ORDER[status] > _ORDER[self.status]:
            self.status = status
        self.why.append(why)


def throughput(value: float, median: float, what: str, v: Verdict) -> None:
    if median <= 0:
        return
    if value < FAILED_BELOW * median:
        v.worse(FAILED, f"{what} {value:.1f} MB/s is under {FAILED_BELOW:.0%} of the median "
                        f"{median:.1f}")  # fmt: skip
    elif value < DEGRADED_BELOW * median:
        v.worse(DEGRADED, f"{what} {value:.1f} MB/s is under {DEGRADED_BELOW:.0%} of the "
                          f"median {median:.1f}")  # fmt: skip


@dataclass(frozen=True)
class Probe:
    a: str
    b: str
    plane: int
    rtt_ms: float
    mbps: float
    retrans: float
    error: str = ""


@dataclass(frozen=True)
class Port:
    """One interface's figures: medians over its pairs."""

    node: str
    plane: int
    rtt_ms: float
    mbps: float
    retrans: float
    errors: tuple[str, ...]


def ports(probes: Sequence[Probe]) -> list[Port]:
    by: dict[tuple[str, int], list[Probe]] = {}
    for p in probes:
        for n in (p.a, p.b):
            by.setdefault((n, p.plane), []).append(p)
    out = []
    for (node, plane), ps in sorted(by.items()):
        ok = [p for p in ps if not p.error]
        errs = tuple(f"{p.a}->{p.b}: {p.error}" for p in ps if p.error)
        rtt, mbps, retrans = (
            (statistics.median(p.rtt_ms for p in ok), statistics.median(p.mbps for p in ok),
             statistics.median(p.retrans for p in ok)) if ok else (0.0, 0.0, 0.0))  # fmt: skip
        out.append(Port(node, plane, rtt, mbps, retrans, errs))
    return out


def judge_link(rtt_ms: float, mbps: float, retrans: float, errors: Sequence[str],
               ref_rtt: float, ref_mbps: float, all_failed: bool = False) -> Verdict:  # fmt: skip
    """One pair or interface against its plane's reference (medians)."""
    v = Verdict()
    for e in errors:
        v.worse(DEGRADED if not all_failed else FAILED, f"probe failed: {e}")
    if all_failed:
        return v
    throughput(mbps, ref_mbps, "throughput", v)
    if rtt_ms > RTT_FACTOR * ref_rtt + RTT_FLOOR_MS:
        v.worse(DEGRADED, f"latency {rtt_ms:.2f} ms is over {RTT_FACTOR:.0f}x the median "
                          f"{ref_rtt:.2f} ms")  # fmt: skip
    if retrans >= RETRANS_FAILED:
        v.worse(FAILED, f"{retrans:.1%} of segments retransmitted")
    elif retrans >= RETRANS_DEGRADED:
        v.worse(DEGRADED, f"{retrans:.1%} of segments retransmitted")
    return v


def references(ps: Sequence[Port]) -> dict[int, tuple[float, float]]:
    """Per plane: the median over its interfaces of (rtt_ms, mbps), from those that measured."""
    out = {}
    for plane in sorted({p.plane for p in ps}):
        ok = [p for p in ps if p.plane == plane and p.mbps > 0]
        out[plane] = ((statistics.median(p.rtt_ms for p in ok),
                       statistics.median(p.mbps for p in ok)) if ok else (0.0, 0.0))  # fmt: skip
    return out


def blame(judged: Sequence[tuple[Probe, Verdict]]) -> dict[tuple[str, int], Verdict]:
    """Which interfaces the bad pairs point at, per plane: the interface(s) with the largest
    share of bad pairs are blamed, their pairs set aside (they explain them), and so on
    until no bad pair is left. One slow port among N makes its N-1 pairs bad and each
    peer's one pair with it: the port is blamed, the peers are not. Two nodes: both are."""
    total: dict[tuple[str, int], int] = {}
    for p, _ in judged:
        for n in (p.a, p.b):
            total[(n, p.plane)] = total.get((n, p.plane), 0) + 1
    out = {k: Verdict() for k in total}
    left = [(p, v) for p, v in judged if v.status != HEALTHY]
    while left:
        bad: dict[tuple[str, int], int] = {}
        for p, _ in left:
            for n in (p.a, p.b):
                bad[(n, p.plane)] = bad.get((n, p.plane), 0) + 1
        top = max(bad[k] / total[k] for k in bad)
        blamed = {k for k in bad if bad[k] / total[k] == top}
        for p, v in left:
            for n in (p.a, p.b):
                if (n, p.plane) in blamed:
                    peer = p.b if n == p.a else p.a
                    for why in v.why:
                        out[(n, p.plane)].worse(v.status, f"with {peer}: {why}")
        left = [(p, v) for p, v in left
                if (p.a, p.plane) not in blamed and (p.b, p.plane) not in blamed]  # fmt: skip
    return out


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | failed | skipped
    value: float = 0.0
    higher_is_better: bool = False
    detail: str = ""


def judge_nodes(
    checks: dict[str, Sequence[Check]], unreachable: dict[str, str]
) -> dict[str, Verdict]:
    """Each node: failed if a check failed or it did not answer; degraded if a measured
    value is past DEGRADED_BELOW of the median of the nodes that measured it."""
    out = {n: Verdict() for n in [*checks, *unreachable]}
    for n, why in unreachable.items():
        out[n].worse(FAILED, f"did not answer the audit: {why}")
    medians: dict[str, float] = {}
    names = {c.name for cs in checks.values() for c in cs if c.higher_is_better}
    for name in names:
        vals = [c.value for cs in checks.values() for c in cs
                if c.name == name and c.status == "ok" and c.value > 0]  # fmt: skip
        if vals:
            medians[name] = statistics.median(vals)
    for n, cs in checks.items():
        for c in cs:
            if c.status == "failed":
                out[n].worse(FAILED, f"{c.name}: {c.detail}")
            elif c.status == "ok" and c.name in medians:
                throughput(c.value, medians[c.name], c.name, out[n])
    return out
