"""Who slows or stalls a running job, as pure functions of what its ranks and agents said.

    slowest rank  A collective completes only once every member issued it: the member that
                  issues last waits least, its peers wait for it. On the job's main group (the
                  one with the most collectives), lined up by sequence number, a collective
                  whose ranks' latencies differ by MIN_GAP_S or more waited for its last
                  member (the one with the lowest latency); one where they all arrived
                  together says nothing of who is slow. The rank last in most of those is the
                  straggler when it stands out: last in at least `last_share_needed(N)` of
                  them (twice its share were all N ranks alike, within [0.25, 0.6]) and twice
                  as often as any other rank, its peers waiting for it at least STEP_SHARE of
                  a step. Its node is the slowest node. (A mean
                  would not do: a rank slowed as a whole, its communicator's threads too, has
                  long latencies of its own, yet it still is the last to join most of them.)
    slowest link  Per node pair, the worst smoothed RTT of the ranks' connections between them
                  (either side's view). Pairs above both 3x the median pair and the median
                  plus 2 ms are slow; when every slow pair shares one node and it has more
                  than one, that node's link is named, else the worst pair.
    hang          A collective in flight for `hang_s` or more: the rank the others wait for
                  is the stopped or silent one, else the one behind on a group
                  (detect.behind_rank).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from snapshotter.coordinator import detect
from snapshotter.hook.barrier import CHANNEL_MARK
from snapshotter.v1 import common_pb2

LAST_SHARE = (0.25, 0.6)  # the bounds of the share it must be the last to join
LAST_LEAD = 2.0  # and that many times the share of the runner-up
MIN_ALIGNED = 8  # collectives every rank reported, at least
STEP_SHARE = 0.1  # its peers wait for it at least this share of a step
MIN_GAP_S = 0.001
LINK_RATIO = 3.0
LINK_MIN_EXTRA_MS = 2.0
DEFAULT_HANG_S = 10.0


@dataclass(frozen=True)
class RankRow:
    rank: int
    node: str
    answered: bool
    proc_state: str
    steps: int
    step_s: float
    latency_s: float  # mean latency of its main group's collectives (0: none seen)
    per_step: float  # collectives it issues on the main group per optimizer step
    in_flight_s: float
    recent: Mapping[int, float] = field(default_factory=dict)  # seq -> latency, main group

    @property
    def wait_s(self) -> float:
        """Seconds a step it waits in collectives of the main group."""
        return self.latency_s * self.per_step

    @property
    def busy_s(self) -> float:
        return max(0.0, self.step_s - self.wait_s) if self.step_s else 0.0


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rtt_ms: float
    bytes_sent: int
    bytes_retrans: int


@dataclass(frozen=True)
class Lateness:
    """Over the collectives of the main group every rank reported (`aligned`), those that
    waited for their last member (`decisive`): the share of those each rank joined last, and
    by how much its peers' median latency exceeded its own then."""

    aligned: int = 0
    decisive: int = 0
    share: Mapping[int, float] = field(default_factory=dict)
    gaps: Mapping[int, list[float]] = field(default_factory=dict)


@dataclass
class Verdict:
    rows: list[RankRow]
    links: list[Link]
    late: Lateness = field(default_factory=Lateness)
    slowest_rank: int | None = None
    slowest_node: str = ""
    slowest_link: str = ""
    waits_on: int | None = None
    stalled_s: float = 0.0
    findings: list[str] = field(default_factory=list)


def main_group(nodes: Sequence[common_pb2.JobProgress]) -> str:
    """The group (not a point-to-point channel) whose collectives completed most."""
    done: dict[str, int] = {}
    for p in nodes:
        for r in p.ranks:
            for t in r.timings:
                if CHANNEL_MARK not in t.group:
                    done[t.group] = done.get(t.group, 0) + t.done
    return max(sorted(done), key=lambda g: done[g]) if done else ""


def rows(nodes: Sequence[common_pb2.JobProgress]) -> list[RankRow]:
    group = main_group(nodes)
    out = []
    for p in nodes:
        for r in p.ranks:
            t = next((t for t in r.timings if t.group == group), None)
            issued = r.counts.get(group, 0)
            out.append(RankRow(
                rank=r.rank, node=p.node, answered=r.answered, proc_state=r.proc_state,
                steps=r.steps, step_s=r.step_s, latency_s=t.mean_s if t else 0.0,
                per_step=issued / r.steps if r.steps else 0.0, in_flight_s=r.in_flight_s,
                recent=dict(zip(t.seqs, t.latencies_s, strict=False)) if t else {},
            ))  # fmt: skip
    return sorted(out, key=lambda x: x.rank)


@dataclass(frozen=True)
class Straggler:
    row: RankRow
    waited_s: float  # its peers wait for it this long a step (a collective: steps not counted)
    share: float  # it was the last to join this share of the collectives that waited
    decisive: int  # how many collectives waited for their last member
    aligned: int  # how many collectives every rank reported


def lateness(rs: Sequence[RankRow]) -> Lateness:
    timed = [r for r in rs if r.answered and r.recent]
    if len(timed) < 2:
        return Lateness()
    common = set.intersection(*(set(r.recent) for r in timed))
    gaps: dict[int, list[float]] = {}
    for q in common:
        lat = sorted((r.recent[q], r.rank) for r in timed)
        low, who = lat[0]
        gap = statistics.median(x for x, _ in lat[1:]) - low
        if gap >= MIN_GAP_S:
            gaps.setdefault(who, []).append(gap)
    n = sum(len(g) for g in gaps.values())
    share = {r.rank: len(gaps.get(r.rank, [])) / n if n else 0.0 for r in timed}
    return Lateness(len(common), n, share, gaps)


def last_share_needed(n: int) -> float:
    """The share of the collectives a rank of `n` must be the last to join to stand out."""
    low, high = LAST_SHARE
    return max(low, min(high, 2.0 / max(n, 1)))


def straggler(rs: Sequence[RankRow], late: Lateness | None = None) -> Straggler | None:
    """The rank its peers wait for, if one stands out."""
    late = late or lateness(rs)
    if late.decisive < MIN_ALIGNED:
        return None
    who, gaps = max(late.gaps.items(), key=lambda kv: (len(kv[1]), -kv[0]))
    share = late.share[who]
    runner_up = max((v for r, v in late.share.items() if r != who), default=0.0)
    if share < last_share_needed(len(late.share)) or share < LAST_LEAD * runner_up:
        return None
    row = next(r for r in rs if r.rank == who)
    # What its peers waited for it, spread over every collective lined up, times how many a
    # step has: a wait in one of a step's two allreduces is half the mean of the two.
    waited = sum(gaps) / late.aligned * (row.per_step or 1.0)
    timed = [r for r in rs if r.answered and r.step_s]
    step = statistics.median([r.step_s for r in timed] or [0.0])
    if step and waited < STEP_SHARE * step:
        return None
    return Straggler(row, waited, share, late.decisive, late.aligned)


def links(nodes: Sequence[common_pb2.JobProgress], owner: Mapping[str, str]) -> list[Link]:
    """Node pairs as the ranks' connections saw them; `owner` maps an address to its node."""
    pairs: dict[tuple[str, str], Link] = {}
    for p in nodes:
        for peer in p.peers:
            other = owner.get(peer.address)
            if other is None or other == p.node:
                continue
            a, b = sorted((p.node, other))
            old = pairs.get((a, b))
            pairs[(a, b)] = Link(
                a, b, max(peer.rtt_ms, old.rtt_ms if old else 0.0),
                peer.bytes_sent + (old.bytes_sent if old else 0),
                peer.bytes_retrans + (old.bytes_retrans if old else 0),
            )
    return [pairs[k] for k in sorted(pairs)]


def slow_link(ls: Sequence[Link]) -> str:
    if not ls:
        return ""
    median = statistics.median(x.rtt_ms for x in ls)
    floor = min(x.rtt_ms for x in ls)
    # With two or three pairs the median may be the slow one itself: measure against the
    # fastest as well.
    ref = min(median, floor) if len(ls) < 4 else median
    slow = [x for x in ls if x.rtt_ms > max(LINK_RATIO * ref, ref + LINK_MIN_EXTRA_MS)]
    if not slow:
        return ""
    shared = set.intersection(*({x.a, x.b} for x in slow))
    if len(slow) > 1 and len(shared) == 1:
        return f"{shared.pop()} (every link)"
    worst = max(slow, key=lambda x: x.rtt_ms)
    return f"{worst.a} <-> {worst.b}"


def judge(
    nodes: Sequence[common_pb2.JobProgress], owner: Mapping[str, str], hang_s: float
) -> Verdict:
    rs = rows(nodes)
    v = Verdict(rows=rs, links=links(nodes, owner))
    v.stalled_s = max((r.in_flight_s for r in rs if r.answered), default=0.0)
    if v.stalled_s >= hang_s:
        samples = [
            detect.RankSample(rank=r.rank, answered=r.answered, counts=dict(r.counts),
                              steps=r.steps, proc_state=r.proc_state)
            for p in nodes for r in p.ranks if not r.HasField("exit_code")
        ]  # fmt: skip
        v.waits_on = detect.behind_rank(samples)
        who = f"rank {v.waits_on}" if v.waits_on is not None else "no single rank"
        v.findings.append(f"hang: a collective has been in flight {v.stalled_s:.0f}s; "
                          f"{who} is the one the others wait for")  # fmt: skip
    v.late = lateness(rs)
    found = straggler(rs, v.late)
    if found is not None and v.waits_on is None:
        low = found.row
        v.slowest_rank, v.slowest_node = low.rank, low.node
        v.findings.append(
            f"slowest rank: {low.rank} on node {low.node}: the last to join "
            f"{found.share:.0%} of the {found.decisive} collectives (of the latest "
            f"{found.aligned}) that waited for someone; its peers wait "
            f"{found.waited_s * 1000:.0f} ms for it a {'step' if low.step_s else 'collective'}"
        )
    v.slowest_link = slow_link(v.links)
    if v.slowest_link:
        worst = max(v.links, key=lambda x: x.rtt_ms)
        median = statistics.median(x.rtt_ms for x in v.links)
        v.findings.append(f"slowest link: {v.slowest_link} (RTT {worst.rtt_ms:.1f} ms; "
                          f"median {median:.1f} ms)")  # fmt: skip
    return v
