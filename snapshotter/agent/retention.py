"""What an agent that runs for weeks keeps, and what it lets go: pure decisions, no I/O.

Every per-job and per-operation resource has an owner that releases it when the job or
operation ends (agent/runtime.py, agent/node.py). What outlives its owner on purpose (the
record of a finished job, its rank logs, CRIU's logs of past dumps and restores) is kept
within the bounds below; what an owner that died left (a store opened for a launch that never
came, a fetched thaw never restored) expires. Tested in tests/unit/test_retention.py.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Retention:
    # Finished jobs whose status and rank logs stay queryable (the newest ones).
    finished_jobs: int = 100
    # ... and for at most this long after they ended.
    finished_job_age_s: float = 7 * 24 * 3600.0
    # Directories of CRIU logs (one per freeze or thaw) kept for post-mortems.
    criu_log_dirs: int = 50
    # A rendezvous store opened for a launch or thaw that never claimed it (its coordinator
    # died in between).
    unclaimed_store_s: float = 600.0
    # A thaw fetched onto this node but neither restored nor discarded.
    stale_fetch_s: float = 1800.0


def jobs_to_forget(
    finished: Mapping[str, float], now: float, keep: int, max_age_s: float
) -> list[str]:
    """Finished jobs (id -> when it ended) to forget: all but the `keep` newest, and any that
    ended more than `max_age_s` ago. Oldest first."""
    by_age = sorted(finished, key=lambda j: (finished[j], j))
    surplus = max(0, len(by_age) - max(0, keep))
    return [j for i, j in enumerate(by_age) if i < surplus or now - finished[j] > max_age_s]


def dirs_to_prune(dirs: Mapping[str, float], keep: int, in_use: Collection[str]) -> list[str]:
    """Directories (name -> mtime) beyond the `keep` newest, never one `in_use`. Oldest first."""
    candidates = sorted((d for d in dirs if d not in in_use), key=lambda d: (dirs[d], d))
    newest_kept = max(0, keep - sum(1 for d in dirs if d in in_use))
    return candidates[: max(0, len(candidates) - newest_kept)]


def expired(opened: Mapping[str, float], now: float, ttl_s: float) -> list[str]:
    """Keys opened (key -> when, monotonic) more than `ttl_s` ago."""
    return sorted(k for k, t in opened.items() if now - t > ttl_s)
