"""Which processes the test session started, and which of them are still running.

Every test runs inside one cgroup made for the session (cgroup v2 where it is mounted at
/sys/fs/cgroup, else the v1 `pids` hierarchy): membership is inherited by every process
forked from it and survives what a process tree does not (daemonizing, re-parenting,
`setsid`, PID namespaces), so an embedded daemon, a rank sandbox or a CRIU-restored tree
started by a test is found even after its parent is gone. Without a writable cgroup the
census falls back to the descendants of the pytest process.

Fixtures whose services outlive a single test (a SeaweedFS server for the session, a
multi-node deployment for a module) `keep()` them; their descendants count as theirs.
Processes are named by (pid, kernel start time), so a reused pid is never confused.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

Proc = tuple[int, str]  # (pid, start time)
SCOPES = ("function", "module", "session")


def start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (its parent died first)."""
    return _state(pid) in ("X", "Z")


def children(pid: int) -> list[int]:
    """The direct children of `pid` (none once it is gone)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def describe(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {' '.join(a.decode(errors='replace') for a in argv if a)[:200]}"


@dataclass
class _Kept:
    scope: str
    owner: str


class Census:
    def __init__(self) -> None:
        self.me = os.getpid()
        self._cgroup: Path | None = None
        self._home: Path | None = None  # the cgroup pytest came from
        self._kept: dict[Proc, _Kept] = {}

    # ---- session ---------------------------------------------------------------------------
    def start(self) -> None:
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/pids")):
            if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
                continue
            group = root / f"snapshotter-tests-{self.me}"
            try:
                group.mkdir(exist_ok=True)
                home = root / _own_cgroup(root)
                (group / "cgroup.procs").write_text(str(self.me))
            except OSError:
                with contextlib.suppress(OSError):
                    group.rmdir()
                continue
            self._cgroup, self._home = group, home
            return

    def stop(self) -> None:
        if self._cgroup is None or self._home is None:
            return
        with contextlib.suppress(OSError):
            (self._home / "cgroup.procs").write_text(str(self.me))
        for _ in range(20):
            try:
                self._cgroup.rmdir()
                return
            except OSError:
                time.sleep(0.1)

    @property
    def mechanism(self) -> str:
        return str(self._cgroup) if self._cgroup is not None else "descendants of pytest"

    # ---- processes -------------------------------------------------------------------------
    def running(self) -> set[Proc]:
        """Every live process the session started (zombies have exited: not running)."""
        if self._cgroup is not None:
            try:
                pids = {int(x) for x in (self._cgroup / "cgroup.procs").read_text().split()}
            except OSError:
                pids = set()
        else:
            pids = _descendants(self.me)
        pids.discard(self.me)
        out = set()
        for pid in pids:
            st = start_time(pid)
            if st is not None and _state(pid) not in ("Z", "X"):
                out.add((pid, st))
        return out

    def keep(self, pid: int, scope: str, owner: str) -> None:
        """`pid` (and what it starts) belongs to a fixture of `scope`, not to the test."""
        assert scope in SCOPES, scope
        st = start_time(pid)
        if st is not None:
            self._kept[(pid, st)] = _Kept(scope, owner)

    def unkeep(self, pid: int) -> None:
        for key in [k for k in self._kept if k[0] == pid]:
            del self._kept[key]

    def _owned_beyond(self, procs: Iterable[Proc], scope: str) -> set[Proc]:
        """Processes kept by fixtures of a scope wider than `scope`, with their descendants."""
        wider = SCOPES[SCOPES.index(scope) + 1 :]
        roots = {pid for (pid, st), k in self._kept.items() if k.scope in wider}
        out = set()
        for proc in procs:
            pid: int | None = proc[0]
            while pid is not None and pid > 1:
                if pid in roots:
                    out.add(proc)
                    break
                pid = _ppid(pid)
        return out

    def leftovers(self, before: set[Proc], scope: str, grace_s: float = 10.0) -> list[Proc]:
        """What started since `before` and still runs after `grace_s` (processes that are
        stopping get that long), except what wider-scoped fixtures keep."""
        deadline = time.monotonic() + grace_s
        while True:
            now = self.running() - before
            left = sorted(now - self._owned_beyond(now, scope))
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill(self, procs: Iterable[Proc]) -> None:
        """SIGKILL these (ours: started by the session), checking each is still itself."""
        for pid, st in procs:
            if start_time(pid) == st:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _own_cgroup(root: Path) -> str:
    """This process's cgroup path in the hierarchy mounted at `root`, relative to it."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = root.name  # e.g. "pids"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (root == Path("/sys/fs/cgroup") and controllers == "") or v1 in controllers.split(","):
            return path.lstrip("/")
    return ""


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            pp = _ppid(int(entry.name))
            if pp is not None:
                kids.setdefault(pp, []).append(int(entry.name))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


CENSUS = Census()


@contextlib.contextmanager
def guard(scope: str, what: str) -> Iterator[None]:
    """Fail `what` if a process it started is still running at its end (and end it)."""
    before = CENSUS.running()
    yield
    left = CENSUS.leftovers(before, scope)
    if left:
        names = [describe(pid) for pid, _ in left]
        CENSUS.kill(left)
        raise AssertionError(
            f"{what} left {len(left)} process(es) running (now killed):\n  " + "\n  ".join(names)
        )
