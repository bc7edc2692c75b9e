"""Small facts about processes, shared by the CLI, the agent, the coordinator and the tests."""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists (also one we may not signal)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lower_this_thread(nice: int) -> bool:
    """Give the calling thread the CPU priority `nice` (0..19; Linux keeps it per thread, and
    the threads it starts inherit it). False when the kernel refused."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class Resources:
    """What one process holds: what must not grow with the jobs and operations it handled."""

    pid: int
    fds: int
    threads: int
    children: int  # live child processes
    zombies: int  # exited children nobody reaped
    rss_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resources(pid: int | None = None) -> Resources:
    """The resources of `pid` (default: this process), read from /proc.

    Raises:
        ProcessLookupError: no such process.
    """
    pid = os.getpid() if pid is None else pid
    base = Path(f"/proc/{pid}")
    try:
        fds = len(os.listdir(base / "fd"))
        status = (base / "status").read_text()
    except FileNotFoundError as e:
        raise ProcessLookupError(pid) from e
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    alive, zombies = _children_of(pid)
    return Resources(
        pid=pid,
        fds=fds,
        threads=int(fields["Threads"]),
        children=alive,
        zombies=zombies,
        rss_bytes=int(fields.get("VmRSS", "0 kB").split()[0]) * 1024,
    )


def child_processes(pid: int | None = None) -> list[tuple[int, str, str]]:
    """(pid, state, comm) of every child of `pid` (default: this process), from /proc."""
    parent = os.getpid() if pid is None else pid
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        head, _, rest = stat.rpartition(")")
        fields = rest.split()
        if len(fields) > 1 and int(fields[1]) == parent:
            out.append((int(entry.name), fields[0], head.partition("(")[2]))
    return out


def _children_of(pid: int) -> tuple[int, int]:
    kids = child_processes(pid)
    zombies = sum(1 for _, state, _ in kids if state == "Z")
    return len(kids) - zombies, zombies


def sandbox_pids(init_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Host pids of every descendant of a sandbox init, parents first (the init excluded)."""
    out: list[int] = []
    todo = [init_pid]
    seen = {init_pid}
    while todo:
        pid = todo.pop(0)
        try:
            tasks = list((proc / str(pid) / "task").iterdir())
        except OSError:
            continue
        for t in tasks:
            try:
                kids = (t / "children").read_text().split()
            except OSError:
                continue
            for k in kids:
                c = int(k)
                if c not in seen:
                    seen.add(c)
                    out.append(c)
                    todo.append(c)
    return out


# /proc states of a process that cannot run until it is continued (SIGSTOP, a tracer).
STOPPED_STATES = ("T", "t")


def proc_state(pid: int, proc: Path = Path("/proc")) -> str:
    """The state letter of `pid` in /proc/<pid>/stat (R running, S sleeping, D disk wait,
    T stopped, t traced, Z zombie, X dead), or "" when there is no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return ""
    # The name (field 2) is in parentheses and may itself hold ") ": the state follows the last.
    fields = stat[stat.rfind(")") + 1 :].split()
    return fields[0] if fields else ""


def first_child(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The oldest living child of `pid` (the kernel lists children in the order they were
    forked or adopted), or None. For a sandbox init that is the rank: the init forks only it."""
    try:
        kids = (proc / str(pid) / "task" / str(pid) / "children").read_text().split()
    except OSError:
        return None
    return int(kids[0]) if kids else None
