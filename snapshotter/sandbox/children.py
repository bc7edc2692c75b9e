"""The child processes of this process: each has one owner that waits for it, and the ones
nobody owns are reaped here.

The agent is a child subreaper (sandbox inits are re-parented to it), so besides the children
it starts itself it also inherits orphans: CRIU's helpers, and the root task a failed
`criu restore --restore-sibling` forked as our child (CLONE_PARENT) before it gave up, whose
pid nobody ever learns. Unreaped, each stays a zombie for the life of the agent.

Rules that make reaping safe (a reaper must never steal the status of a child whose owner
will wait for it):
- code that creates a child does so inside `spawning()` and makes it owned before leaving:
  `popen()`/`run()` for subprocesses (owned while their Popen has no returncode), `own(pid)`
  for children found another way (a sandbox init, a restored tree's root);
- an owner that reaped its child itself calls `release(pid)`;
- `reap_strays()` only runs while no `spawning()` block is open (it skips the round
  otherwise), and only reaps zombies that are children of this process and owned by nobody.

Nothing here kills a process; it only collects exit statuses and counts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from snapshotter.procutil import child_processes

log = logging.getLogger(__name__)

_cv = threading.Condition()
_spawning = 0
_pids: set[int] = set()
_popens: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()


@contextlib.contextmanager
def spawning() -> Iterator[None]:
    """Hold off the reaper while children are being created (re-entrant, shared)."""
    global _spawning
    with _cv:
        _spawning += 1
    try:
        yield
    finally:
        with _cv:
            _spawning -= 1
            _cv.notify_all()


def own(pid: int) -> None:
    with _cv:
        _pids.add(pid)


def release(pid: int) -> None:
    with _cv:
        _pids.discard(pid)


def popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """subprocess.Popen, owned by the returned object until it is waited for."""
    with spawning():
        p: subprocess.Popen[Any] = subprocess.Popen(args, **kwargs)
        with _cv:
            _popens.add(p)
    return p


def run(args: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run, with the child owned until it is reaped."""
    with spawning():
        return subprocess.run(args, **kwargs)


def reap_strays() -> list[tuple[int, str, int]]:
    """Reap zombie children nobody owns; return (pid, comm, exit code) of each. Does nothing
    while a child is being created (the next round reaps what this one skipped)."""
    with _cv:
        if _spawning:
            return []
        # Inside the lock: no new child can appear unowned while we look.
        owned = _owned_locked()
        zombies = [(pid, comm) for pid, state, comm in child_processes() if state == "Z"]
        reaped = []
        for pid, comm in zombies:
            if pid in owned:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if got == pid:
                reaped.append((pid, comm, os.waitstatus_to_exitcode(status)))
    for pid, comm, code in reaped:
        log.info("reaped stray child %d (%s), exit %d", pid, comm, code)
    return reaped


def _owned_locked() -> set[int]:
    return set(_pids) | {p.pid for p in list(_popens) if p.returncode is None}
