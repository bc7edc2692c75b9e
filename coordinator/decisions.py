"""Coordinator decisions as pure functions of (now, state, config): no I/O, no clocks read.

Tested without gRPC or processes (tests/unit/test_decisions.py).
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from snapshotter import errors


def pick_targets(counts_by_rank: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """The collective every member of each group will stop before: one past the most any
    member has issued. Every member can reach it (all below it are issued by someone, so peers
    will match them), and no member has passed it."""
    targets: dict[str, int] = {}
    for counts in counts_by_rank.values():
        for group, n in counts.items():
            targets[group] = max(targets.get(group, 0), int(n) + 1)
    return targets


# Heartbeats the coordinator takes per second before it asks agents to beat less often: 2,048
# agents beating every 2 s cost it a third of a core (bench/scale_bench.py).
MAX_BEATS_PER_S = 512.0
# A node is lost after this many of the intervals it was asked to keep passed without a beat.
LOST_AFTER_BEATS = 3


def beat_interval(agents: int, max_per_s: float) -> float:
    """The heartbeat interval to ask of every agent so that `agents` of them beat at most
    `max_per_s` times a second together (an agent keeps its own interval when that is longer;
    0: no bound)."""
    return agents / max_per_s if max_per_s > 0 else 0.0


def lost_after(ttl_s: float, beat_s: float) -> float:
    """Seconds without a heartbeat before an agent asked to beat every `beat_s` is lost: the
    configured ttl, or `LOST_AFTER_BEATS` of its intervals when those are longer."""
    return max(ttl_s, LOST_AFTER_BEATS * beat_s)


def place(nnodes: int, requested: Sequence[str], live: Iterable[str]) -> list[str]:
    """The agents that take a job's nodes, in node-rank order: the ones requested (each once,
    each live), or else the first `nnodes` live ones by name.

    Raises:
        ServiceUnavailable: no agent is live at all.
        InvalidArgument: an unknown or repeated node, or not enough nodes.
    """
    alive = sorted(set(live))
    if not alive:
        raise errors.ServiceUnavailable(
            "no node agent is registered with the coordinator",
            "start an agent on each node (`snapshotter agent`), or use the embedded default",
        )
    if requested:
        live_set = set(alive)
        unknown = [n for n in requested if n not in live_set]
        if unknown:
            raise errors.InvalidArgument(
                f"{len(unknown)} unknown or unreachable node(s): {errors.few(unknown)}",
                f"live nodes ({len(alive)}): {errors.few(alive)}",
            )
        repeated = sorted(n for n, k in Counter(requested).items() if k > 1)
        if repeated:
            raise errors.InvalidArgument(
                f"node(s) {errors.few(repeated)} named more than once",
                "name each node once with --nodes",
            )
        chosen = list(requested)
    else:
        chosen = alive[:nnodes]
    if len(chosen) != nnodes:
        raise errors.InvalidArgument(
            f"the job needs {nnodes} node(s) but {len(chosen)} "
            + ("were given" if requested else "are live"),
            f"live nodes ({len(alive)}): {errors.few(alive)}",
        )
    return chosen


def snapshot_id(job_id: str, now: datetime, suffix: str) -> str:
    """`<job>-<UTC yyyymmddThhmmss>-<suffix>`: sortable by time within a job."""
    return f"{job_id}-{now.astimezone(UTC).strftime('%Y%m%dT%H%M%S')}-{suffix}"


_FORK = re.compile(r"^(?P<base>.+?)(?:\.(?P<n>\d+))?$")


def thaw_job_id(
    source_job: str, requested: str | None, active: Iterable[str], known: Iterable[str]
) -> str:
    """The id of a thawed job. An explicit id must not be active. Without one, the job keeps
    its id when nothing by that id runs (it simply continues); otherwise the thaw is a fork and
    gets the next free `<job>.<n>`."""
    active_set = set(active)
    if requested is not None:
        if requested in active_set:
            raise errors.InvalidArgument(
                f"job {requested} is already running", "choose another --job-id for the thaw"
            )
        return requested
    if source_job not in active_set:
        return source_job
    taken = active_set | set(known)
    n = 1
    while f"{source_job}.{n}" in taken:
        n += 1
    return f"{source_job}.{n}"


class JobPhase(enum.Enum):
    """A job as the coordinator reports it.

    (run) -> RUNNING <-> FREEZING          freeze-and-continue returns to RUNNING
             RUNNING <-> MIGRATING         one node's ranks move; the others stay in memory
             RUNNING <-> REROUTING         communicators move to another data-link plane
             RUNNING  -> FREEZING -> FROZEN  freeze --stop: ranks end after the commit
             RUNNING  -> SUCCEEDED | FAILED | CANCELLED
    (thaw) -> THAWING -> RUNNING | FAILED
    --recover auto: RUNNING --a rank, node or the job's progress failed--> RECOVERING
             RECOVERING -> THAWING -> RUNNING  (its newest snapshot, on healthy nodes)
             RECOVERING -> FAILED              (gave up: no snapshot, or K tries in a window)
    """

    RECOVERING = "RECOVERING"
    THAWING = "THAWING"
    RUNNING = "RUNNING"
    FREEZING = "FREEZING"
    MIGRATING = "MIGRATING"
    REROUTING = "REROUTING"
    FROZEN = "FROZEN"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobPhase.FROZEN, JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED)


def job_phase(busy: str | None, node_states: Iterable[str]) -> JobPhase:
    """Combine the coordinator's own operation and the agents' view of the ranks.
    UNREACHABLE (a node whose agent does not answer while its heartbeat lasts: restarting
    under its keeper, its ranks training on) counts as running."""
    if busy is not None:
        return JobPhase(busy)
    states = set(node_states)
    if not states:
        return JobPhase.FAILED
    for terminal in ("FAILED", "CANCELLED", "FROZEN"):
        if terminal in states:
            if states <= {terminal, "SUCCEEDED", "RUNNING"} and "RUNNING" in states:
                return JobPhase.RUNNING  # other nodes are still winding down
            return JobPhase(terminal)
    if states == {"SUCCEEDED"}:
        return JobPhase.SUCCEEDED
    return JobPhase.RUNNING


def supervised_phase(
    phase: JobPhase,
    busy: str | None,
    recovers: bool,
    recovering: bool,
    gave_up: bool,
    cancelled: bool,
) -> JobPhase:
    """The phase reported for a job under `--recover auto`, from `job_phase`'s.

    A job that failed is RECOVERING while the supervisor will thaw it. So is one that was
    CANCELLED, unless a person cancelled it: the only other canceller of a running job is a
    freeze that lost a node (its ranks elsewhere are stopped so none waits for the lost
    ones), and that job must be recovered, not reported over. Once recovery gave up, what
    it stopped is FAILED."""
    if busy is not None:
        return phase
    if recovering:
        return JobPhase.RECOVERING
    if phase in (JobPhase.FAILED, JobPhase.CANCELLED) and recovers and not (gave_up or cancelled):
        return JobPhase.RECOVERING  # the supervisor will thaw it: not over yet
    if gave_up and phase is JobPhase.CANCELLED and not cancelled:
        return JobPhase.FAILED  # we ended what was left of it: it failed
    return phase


def exit_code(phase: JobPhase, rank_codes: Iterable[int | None]) -> int:
    """The exit code `snapshotter run`/`wait` return: the first failing rank's, like torchrun."""
    if phase is JobPhase.SUCCEEDED or phase is JobPhase.FROZEN:
        return 0
    for c in rank_codes:
        if c not in (None, 0):
            return int(c)  # type: ignore[arg-type]
    return 1


def recovery_nodes(
    current: Sequence[str],
    failed: Iterable[str],
    live: Iterable[str],
    spares: Sequence[str],
    avoid: Iterable[str] = (),
) -> list[str]:
    """Where a recovered job runs, in node-rank order: its own nodes where they are healthy
    (a rank that died leaves its node usable), each failed or avoided (draining) node
    replaced by the first live spare, then by any other live node, none used twice.

    Raises: ServiceUnavailable when too few healthy nodes are left.
    """
    bad = set(failed) | set(avoid)
    alive = [n for n in sorted(set(live)) if n not in bad]
    keep = [n if n in alive else None for n in current]
    taken = {n for n in keep if n is not None}
    pool = [n for n in spares if n in alive and n not in taken]
    pool += [n for n in alive if n not in taken and n not in pool]
    out: list[str] = []
    for n in keep:
        if n is None:
            if not pool:
                raise errors.ServiceUnavailable(
                    f"no healthy node is left to replace {sorted(bad & set(current))} "
                    f"(live: {sorted(set(live))})",
                    "register another agent or name spares with --spares",
                )
            n = pool.pop(0)
        out.append(n)
    return out


DEFAULT_MAX_TRIES = 3
DEFAULT_WINDOW_S = 3600.0
DEFAULT_HANG_DEADLINE_S = 600.0


def may_recover(recoveries: Sequence[float], now: float, max_tries: int, window_s: float) -> bool:
    """Another automatic recovery is allowed unless `max_tries` already happened within the
    last `window_s` seconds: a job that fails the same way after every thaw (a bug at step
    N) is not recovered forever."""
    recent = [t for t in recoveries if now - t <= window_s]
    return len(recent) < max_tries


def usable_planes(links: Sequence[Sequence[bool]]) -> list[int]:
    """The data-link planes a job on these nodes can use: `links[n][p]` says whether node n's
    link of plane p is up and not drained (a node without data links: `[True]`, its one
    plane). A plane must exist and be usable on every node (pure)."""
    if not links:
        return []
    planes = min(len(n) for n in links)
    return [p for p in range(planes) if all(n[p] for n in links)]


def next_plane(current: int, links: Sequence[Sequence[bool]], home: int = 0) -> int | None:
    """Where a job on plane `current` should be: where it is while that plane is usable
    (never back and forth with a flapping link), else its home plane, else the lowest usable
    one; None when no plane is usable (pure)."""
    usable = usable_planes(links)
    if current in usable:
        return current
    if home in usable:
        return home
    return usable[0] if usable else None


def bridge_routes(
    peers: Mapping[str, Sequence[str]], me: str, frm: int, to: int
) -> list[tuple[str, str]]:
    """The routes node `me` needs so that its traffic to every peer's plane-`frm` address goes
    through that peer's plane-`to` address: (destination, gateway) pairs. `peers[node]` is
    the node's addresses by plane; a peer lacking either address gets no route (pure)."""
    out = []
    for node in sorted(peers):
        ips = peers[node]
        if node == me or len(ips) <= max(frm, to) or not ips[frm] or not ips[to]:
            continue
        out.append((ips[frm], ips[to]))
    return out


def other_plane(current: int, links: Sequence[Sequence[bool]]) -> int | None:
    """The lowest usable plane other than `current` (pure)."""
    return next((p for p in usable_planes(links) if p != current), None)


def link_suspect(in_flight: Mapping[int, float], deadline_s: float) -> tuple[int, float] | None:
    """(the rank waiting longest, how long) when every rank has had a collective in flight
    for longer than `deadline_s`: they all wait on the network, not on one slow rank (which
    would have issued nothing and show no wait). None otherwise (pure)."""
    if not in_flight or min(in_flight.values()) <= deadline_s:
        return None
    rank = max(sorted(in_flight), key=lambda r: in_flight[r])
    return rank, in_flight[rank]
