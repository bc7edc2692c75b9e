"""Failure detection as pure functions: what the agents and the ranks' hooks last said, in;
the failure (or None), out. The supervisor (supervisor.py) samples and acts.

    rank failure  a rank exited non-zero or by a signal (the agent ends its peers: fail-fast)
    node lost     the node's agent missed its heartbeats for the coordinator's TTL
    hang          every rank alive, yet no collective completed for `deadline` seconds
                  (once the job's first collective was issued: start-up is no hang). A
                  collective completes only once every member issued it, so what completed
                  is, per group, the fewest any member issued: one rank issuing ahead of a
                  stuck peer (as a parked rank does when a freeze gives up) is no progress;
                  the rank behind is the one that stopped answering (or is stopped), else the
                  one that issued the fewest collectives on a group where its peers issued more
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from snapshotter.procutil import STOPPED_STATES

# A rank its agent ended because a peer failed first (fail-fast) exits by one of these.
_ENDED_BY_AGENT = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL)


@dataclass(frozen=True)
class Failure:
    cause: str  # rank_exit | rank_signal | node_lost | hang | gpu_error
    detail: str
    rank: int | None = None
    node: str | None = None
    # Seconds between the failure (as near as the samples tell) and its detection.
    detect_s: float | None = None

    @property
    def lost_node(self) -> bool:
        return self.cause == "node_lost"


def gpu_failure(faults: Mapping[str, Sequence[Any]]) -> Failure | None:
    """The first node whose GPUs reported a fatal fault (XID, uncorrected ECC) since
    the job started there: the job must leave it. `faults` maps node -> GpuFault messages."""
    for node, found in faults.items():
        fatal = [f for f in found if f.fatal]
        if fatal:
            return Failure("gpu_error", f"node {node}: {fatal[0].detail}", node=node)
    return None


def signal_name(code: int) -> str | None:
    """The signal a rank's exit code stands for (negative: killed by it; 128+n: its shell)."""
    n = -code if code < 0 else code - 128 if code > 128 else 0
    if n <= 0:
        return None
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def rank_failure(codes: Mapping[int, int | None], first: Iterable[int] = ()) -> Failure | None:
    """The rank that failed, from every rank's exit code (None: still running). `first`: the
    ranks an agent saw fail before it ended their peers (one per failed node; the lowest wins),
    else one that did not exit by the agent's signals, else the lowest that failed."""
    failed = {r: c for r, c in sorted(codes.items()) if c not in (None, 0)}
    if not failed:
        return None
    firsts = {r: failed[r] for r in sorted(first) if r in failed}
    own = {r: c for r, c in failed.items() if c not in _ENDED_BY_AGENT}
    rank, code = next(iter((firsts or own or failed).items()))
    assert code is not None
    sig = signal_name(code)
    if sig is not None:
        return Failure("rank_signal", f"rank {rank} was killed by {sig}", rank=rank)
    return Failure("rank_exit", f"rank {rank} exited with code {code}", rank=rank)


def lost_nodes(job_nodes: Sequence[str], live: Iterable[str]) -> list[str]:
    alive = set(live)
    return [n for n in job_nodes if n and n not in alive]


@dataclass(frozen=True)
class RankSample:
    rank: int
    answered: bool
    counts: Mapping[str, int] = field(default_factory=dict)
    steps: int = 0
    proc_state: str = ""


@dataclass(frozen=True)
class Progress:
    """What the supervisor remembers of a job's progress between samples."""

    # rank -> its collective counts and optimizer steps as last seen
    seen: Mapping[int, tuple[tuple[tuple[str, int], ...], int]] = field(default_factory=dict)
    steps: int | None = None  # the most any rank reported: the job's optimizer steps
    # Some rank ever answered a progress query: ranks whose hook predates the query (thawed
    # from an old snapshot) never do, and silence alone is no hang.
    answering: bool = False
    # What the job as a whole completed (`frontier`), and when that last moved.
    completed: tuple[tuple[tuple[str, int], ...], int] = ((), 0)
    moved: float | None = None


def frontier(
    seen: Mapping[int, tuple[tuple[tuple[str, int], ...], int]],
) -> tuple[tuple[tuple[str, int], ...], int]:
    """Per group, the fewest collectives any of its members issued (what completed), and the
    fewest optimizer steps any rank took."""
    low: dict[str, int] = {}
    for key, _ in seen.values():
        for g, n in key:
            low[g] = min(low.get(g, n), n)
    steps = min((st for _, st in seen.values()), default=0)
    return tuple(sorted(low.items())), steps


def observe(p: Progress, samples: Sequence[RankSample], now: float) -> Progress:
    """The progress after one sample. A rank that did not answer keeps what it last said
    (it did not move); the job moved when what it completed did."""
    seen = dict(p.seen)
    for s in samples:
        if s.answered:
            seen[s.rank] = (tuple(sorted(s.counts.items())), s.steps)
        else:
            seen.setdefault(s.rank, ((), 0))
    answered = [s.steps for s in samples if s.answered]
    steps = max(answered) if answered else p.steps
    done = frontier(seen)
    moved = now if p.moved is None or done != p.completed else p.moved
    return Progress(seen=seen, steps=steps, answering=p.answering or bool(answered),
                    completed=done, moved=moved)  # fmt: skip


def reset(p: Progress, now: float) -> Progress:
    """The job's clock starts again (it was frozen, thawed or restarted: a freeze holds
    collectives on purpose)."""
    return Progress(seen=p.seen, steps=p.steps, answering=p.answering, completed=p.completed,
                    moved=now if p.seen else p.moved)  # fmt: skip


def stalled_for(p: Progress, now: float) -> float | None:
    """Seconds since the job last completed a collective or a step (None before the first
    sample)."""
    if not p.seen or p.moved is None:
        return None
    return now - p.moved


def hang(
    p: Progress, samples: Sequence[RankSample], now: float, deadline_s: float
) -> Failure | None:
    if not samples or not p.seen or not p.answering or not _collectives_began(p):
        return None
    if any(s.rank not in p.seen for s in samples) or p.moved is None:
        return None
    stalled_for = now - p.moved
    if stalled_for < deadline_s:
        return None
    behind = behind_rank(samples)
    who = f"rank {behind}" if behind is not None else "no single rank"
    return Failure(
        "hang",
        f"no collective completed for {stalled_for:.0f}s (deadline "
        f"{deadline_s:.0f}s); {who} is the one the others wait for",
        rank=behind,
        detect_s=stalled_for,
    )


def _collectives_began(p: Progress) -> bool:
    """Some rank issued a collective. Before that the job starts up (imports, data, model:
    minutes for a large job, seconds more on a busy node), which is no hang."""
    return any(n > 0 for key, _ in p.seen.values() for _, n in key)


def behind_rank(samples: Sequence[RankSample]) -> int | None:
    stopped = [s.rank for s in samples if s.proc_state in STOPPED_STATES]
    if stopped:
        return min(stopped)
    silent = [s.rank for s in samples if not s.answered]
    if silent:
        return min(silent)
    groups = sorted({g for s in samples for g in s.counts})
    for g in groups:
        have = {s.rank: s.counts[g] for s in samples if g in s.counts}
        if len(set(have.values())) > 1:
            low = min(have.values())
            return min(r for r, n in have.items() if n == low)
    return None


# torch.distributed prefixes a rank's error output with "[rankN]: ".
_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
_TRACEBACK = "Traceback (most recent call last):"


def last_traceback(log_tail: str, limit: int = 4000) -> str:
    """The last Python traceback in a rank's output (its final lines if there is none)."""
    lines = [_PREFIX.sub("", ln) for ln in log_tail.rstrip().splitlines()]
    starts = [i for i, ln in enumerate(lines) if ln.rstrip() == _TRACEBACK]
    if not starts:
        return "\n".join(lines[-10:])[-limit:]
    out = [lines[starts[-1]]]
    for ln in lines[starts[-1] + 1 :]:
        out.append(ln)
        # The exception line ends the block: the first non-indented line after the frames.
        if ln and not ln.startswith((" ", "\t")):
            break
    return "\n".join(out)[-limit:]
