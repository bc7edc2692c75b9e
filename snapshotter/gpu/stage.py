"""The node's GPU stage around CRIU: GPU state into host memory before a dump, back after.

    freeze:  lock every CUDA process of the node's ranks  (parallel, timeout)
             -> checkpoint every one                     (parallel)
             ... CRIU dumps the ranks (now plain host processes) ...
    release: restore + unlock every one, same GPUs       (parallel)
    thaw:    plan the GPU mapping before any process starts (refuse when impossible)
             ... CRIU restores the ranks: their CUDA state is CHECKPOINTED ...
             restore onto the mapped GPUs + unlock        (parallel)

Recovery, so that no process is ever left half-way:
  * a lock fails or times out  -> every process locked so far is unlocked; the job runs on.
  * a checkpoint fails         -> checkpointed ones are restored + unlocked, locked ones
                                  unlocked; the job runs on.
  * a restore fails (release)  -> the others are restored + unlocked; the error says which
                                  process stayed checkpointed (its rank cannot continue).
  * a restore fails (thaw)     -> restored ones are unlocked; the caller kills the ranks. The
                                  snapshot is untouched.

Which processes: the rank process is the sandbox init's child; every descendant is asked for
its state and those without CUDA state (DataLoader workers, normally) are skipped.
This module never talks to CRIU or to the ranks' control channels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter import parallel
from snapshotter.errors import GpuCheckpointError, GpuDriverError, GpuRemapRefused
from snapshotter.gpu.api import NO_CUDA_RESULTS, CheckpointDriver, GpuInfo, ProcessState
from snapshotter.procutil import sandbox_pids

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuStageSettings:
    lock_timeout_s: float = 30.0
    # One checkpoint, restore or unlock of one process; past it the process is reported.
    op_timeout_s: float = 600.0
    parallelism: int = 16


@dataclass
class GpuProc:
    pid: int
    rss_before: int = 0
    state_bytes: int = 0  # host memory the checkpoint added: the GPU state it captured
    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0


@dataclass
class RankGpu:
    rank: int
    procs: list[GpuProc]
    gpus: list[GpuInfo]

    def record(self) -> dict[str, Any]:
        """What the snapshot manifest keeps for this rank."""
        return {
            "gpus": [g.to_dict() for g in self.gpus],
            "processes": len(self.procs),
            "state_bytes": sum(p.state_bytes for p in self.procs),
            "lock_s": max((p.lock_s for p in self.procs), default=0.0),
            "checkpoint_s": max((p.checkpoint_s for p in self.procs), default=0.0),
        }


@dataclass
class GpuHold:
    """The CUDA processes a freeze checkpointed; `release` puts them back."""

    ranks: dict[int, RankGpu] = field(default_factory=dict)
    checkpoint_s: float = 0.0

    def procs(self) -> list[GpuProc]:
        return [p for r in self.ranks.values() for p in r.procs]

    def state_bytes(self) -> int:
        return sum(p.state_bytes for p in self.procs())


# ---------------------------------------------------------------------------- pure decisions


def remap(recorded: Mapping[int, Sequence[GpuInfo]], node: Sequence[GpuInfo]) -> dict[str, str]:
    """Map every GPU the snapshot's ranks used (old uuid) onto one of this node's GPUs.

    A GPU the node has itself keeps its place; the others take distinct unused GPUs of the same
    type (name) with at least as much memory, in order. Ranks that shared a GPU still share one.

    Raises:
        GpuRemapRefused: the node has fewer GPUs of a type than the snapshot used.
    """
    old: dict[str, GpuInfo] = {}
    users: dict[str, list[int]] = {}
    for rank in sorted(recorded):
        for g in recorded[rank]:
            old.setdefault(g.uuid, g)
            users.setdefault(g.uuid, []).append(rank)
    here = {g.uuid for g in node}
    mapping = {u: u for u in old if u in here}
    free = [g for g in node if g.uuid not in mapping.values()]
    missing: list[GpuInfo] = []
    for u, g in old.items():
        if u in mapping:
            continue
        fit = next((n for n in free if n.name == g.name and n.memory >= g.memory), None)
        if fit is None:
            missing.append(g)
            continue
        free.remove(fit)
        mapping[u] = fit.uuid
    if missing:
        need = _count(old.values())
        have = _count(node)
        want = ", ".join(f"{n} x {name}" for name, n in need.items())
        got = ", ".join(f"{n} x {name}" for name, n in have.items()) or "no GPU"
        who = "; ".join(f"{g.uuid} used by rank(s) {users[g.uuid]}" for g in missing)
        raise GpuRemapRefused(
            f"the snapshot's ranks used {want}; this node has {got}: no GPU left for {who}",
            f"thaw onto a node with {want} (same type, at least as much memory each)",
        )
    return mapping


def rank_pairs(gpus: Sequence[GpuInfo], mapping: Mapping[str, str]) -> list[tuple[str, str]] | None:
    """The (old, new) UUID pairs for one process's restore; None when nothing moves (the
    driver then restores onto the same GPUs)."""
    pairs = [(g.uuid, mapping.get(g.uuid, g.uuid)) for g in gpus]
    if all(o == n for o, n in pairs):
        return None
    return pairs


def _count(gpus: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in gpus:
        out[g.name] = out.get(g.name, 0) + 1
    return out


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# ---------------------------------------------------------------------------- the stage


class GpuStage:
    """Drives one node's CUDA processes through a `CheckpointDriver`, in parallel."""

    def __init__(self, driver: CheckpointDriver, settings: GpuStageSettings | None = None) -> None:
        self.driver = driver
        self.settings = settings or GpuStageSettings()

    # ---- discovery -----------------------------------------------------------------------

    def cuda_pids(self, init_pid: int) -> list[tuple[int, ProcessState]]:
        """The sandbox's processes that have CUDA state, with that state."""
        out = []
        for pid in sandbox_pids(init_pid):
            try:
                out.append((pid, self.driver.get_state(pid)))
            except GpuDriverError as e:
                if e.result not in NO_CUDA_RESULTS:
                    raise
        return out

    def _gpus_of(self, pid: int) -> list[GpuInfo]:
        return self.driver.process_gpus(pid) or self.driver.gpus()

    # ---- freeze --------------------------------------------------------------------------

    def freeze(self, ranks: Mapping[int, int]) -> GpuHold:
        """Lock then checkpoint every CUDA process of `ranks` (rank -> sandbox init pid).

        Raises:
            GpuLockTimeout: a process did not lock in time; all are RUNNING again.
            GpuDriverError: a lock or checkpoint failed; all are RUNNING again.
        """
        hold = GpuHold()
        for rank, init_pid in ranks.items():
            found = self.cuda_pids(init_pid)
            for pid, st in found:
                if st is not ProcessState.RUNNING:
                    raise GpuCheckpointError(
                        f"CUDA process {pid} of rank {rank} is {st.name}, not RUNNING",
                        "another checkpoint of this job is in progress or failed; wait, or "
                        "cancel the job",
                    )
            procs = [GpuProc(pid, rss_before=rss_bytes(pid)) for pid, _ in found]
            gpus: dict[str, GpuInfo] = {}
            for p in procs:
                gpus.update({g.uuid: g for g in self._gpus_of(p.pid)})
            hold.ranks[rank] = RankGpu(rank, procs, list(gpus.values()))
        procs = hold.procs()
        if not procs:
            return hold
        t0 = time.monotonic()
        lock_ms = int(self.settings.lock_timeout_s * 1000)
        failed = self._all("lock", procs, lambda p: self._timed(p, "lock_s",
                           lambda: self.driver.lock(p.pid, lock_ms)),
                           self.settings.lock_timeout_s + 10)
        if failed:
            self._settle(procs)
            raise self._first(failed, "lock")
        failed = self._all("checkpoint", procs, lambda p: self._timed(p, "checkpoint_s",
                           lambda: self.driver.checkpoint(p.pid)), self.settings.op_timeout_s)
        if failed:
            self._settle(procs)
            raise self._first(failed, "checkpoint")
        hold.checkpoint_s = time.monotonic() - t0
        for p in procs:
            p.state_bytes = max(0, rss_bytes(p.pid) - p.rss_before)
        log.info("GPU state of %d process(es) checkpointed: %d bytes in %.2fs",
                 len(procs), hold.state_bytes(), hold.checkpoint_s)
        return hold

    def release(self, hold: GpuHold) -> None:
        """Restore + unlock every process of `hold` onto its own GPUs (after the dump).

        Raises:
            GpuDriverError: a process could not be restored; the others run again.
        """
        procs = hold.procs()
        if not procs:
            return
        failed = self._all("restore", procs, lambda p: self._back(p, None),
                           self.settings.op_timeout_s)
        if failed:
            self._settle(procs)  # retries the failed ones once; unlocks any left LOCKED
            raise self._first(failed, "restore")

    # ---- thaw ----------------------------------------------------------------------------

    def plan(self, recorded: Mapping[int, Sequence[GpuInfo]]) -> dict[str, str]:
        """The GPU mapping for a thaw onto this node (call before any process starts).

        Raises:
            GpuRemapRefused: this node lacks GPUs of the snapshot's type or number.
            GpuDriverError: the node's GPUs could not be listed.
        """
        return remap(recorded, self.driver.gpus())

    def thaw(
        self,
        ranks: Mapping[int, int],
        recorded: Mapping[int, Sequence[GpuInfo]],
        mapping: Mapping[str, str],
    ) -> dict[int, dict[str, Any]]:
        """Restore (onto `mapping`) + unlock the CUDA processes of restored ranks.

        Raises:
            GpuCheckpointError: a rank that had GPU state has no checkpointed CUDA process.
            GpuDriverError: a restore or unlock failed; every restored process was unlocked,
                the rest stay CHECKPOINTED for the caller to kill. The snapshot is untouched.
        """
        procs: list[GpuProc] = []
        pairs: dict[int, list[tuple[str, str]] | None] = {}
        out: dict[int, dict[str, Any]] = {}
        for rank, init_pid in ranks.items():
            gpus = list(recorded.get(rank, ()))
            found = [pid for pid, st in self.cuda_pids(init_pid)
                     if st is ProcessState.CHECKPOINTED]
            if gpus and not found:
                raise GpuCheckpointError(
                    f"rank {rank} was checkpointed with GPU state but no process of its "
                    f"restored sandbox (init pid {init_pid}) holds checkpointed CUDA state",
                    "check the NVIDIA driver version on this node; the snapshot is untouched",
                )
            for pid in found:
                procs.append(GpuProc(pid))
                pairs[pid] = rank_pairs(gpus, mapping)
            out[rank] = {"processes": len(found),
                         "gpus": [mapping.get(g.uuid, g.uuid) for g in gpus]}
        if not procs:
            return out
        failed = self._all("restore", procs, lambda p: self._back(p, pairs[p.pid]),
                           self.settings.op_timeout_s)
        if failed:
            self._unlock_locked(procs)
            raise self._first(failed, "restore")
        for rank in out:
            out[rank]["restore_s"] = max((p.restore_s for p in procs), default=0.0)
        return out

    # ---- helpers -------------------------------------------------------------------------

    def _back(self, p: GpuProc, pairs: list[tuple[str, str]] | None) -> None:
        t0 = time.monotonic()
        self.driver.restore(p.pid, pairs)
        p.restore_s = time.monotonic() - t0
        self.driver.unlock(p.pid)

    @staticmethod
    def _timed(p: GpuProc, attr: str, fn: Callable[[], None]) -> None:
        t0 = time.monotonic()
        fn()
        setattr(p, attr, time.monotonic() - t0)

    def _all(
        self, op: str, procs: Sequence[GpuProc], fn: Callable[[GpuProc], None], timeout: float
    ) -> dict[int, BaseException]:
        """Run fn on every process in parallel; the failures by pid (a call still running
        at `timeout` counts as failed and is left to finish in the background)."""

        def overdue(p: GpuProc, t: float) -> BaseException:
            return GpuDriverError(
                op, p.pid, f"no answer within {t:.0f}s",
                "the NVIDIA driver is stuck on this process; cancel the job",
            )  # fmt: skip

        out = parallel.each(
            procs, fn, key=lambda p: p.pid, workers=self.settings.parallelism, timeout=timeout,
            overdue=overdue, name=f"gpu-{op}",
        )  # fmt: skip
        return out.failures

    def _first(self, failed: Mapping[int, BaseException], op: str) -> BaseException:
        for pid, e in sorted(failed.items()):
            log.warning("GPU %s of pid %d failed: %s", op, pid, e)
        return failed[min(failed)]

    def _settle(self, procs: Sequence[GpuProc]) -> None:
        """Bring every process back to RUNNING on its own GPUs, whatever state it reached."""

        def one(p: GpuProc) -> None:
            st = self.driver.get_state(p.pid)
            if st is ProcessState.CHECKPOINTED:
                self.driver.restore(p.pid, None)
                st = ProcessState.LOCKED
            if st is ProcessState.LOCKED:
                self.driver.unlock(p.pid)

        for pid, e in self._all("settle", procs, one, self.settings.op_timeout_s).items():
            log.error("GPU recovery of pid %d failed: %s", pid, e)

    def _unlock_locked(self, procs: Sequence[GpuProc]) -> None:
        def one(p: GpuProc) -> None:
            if self.driver.get_state(p.pid) is ProcessState.LOCKED:
                self.driver.unlock(p.pid)

        for pid, e in self._all("unlock", procs, one, self.settings.op_timeout_s).items():
            log.error("unlock of pid %d after a failed thaw failed: %s", pid, e)


def records_of(ranks: Sequence[Mapping[str, Any]]) -> dict[int, list[GpuInfo]]:
    """The GPUs each rank used, from the manifest's rank records (ranks without GPU state
    are left out)."""
    out: dict[int, list[GpuInfo]] = {}
    for rec in ranks:
        g = rec.get("gpu")
        if g and g.get("processes"):
            out[int(rec["rank"])] = [GpuInfo.from_dict(d) for d in g.get("gpus", [])]
    return out
