"""Which TCP sockets a process holds, read from /proc; the ones the hook opened itself; and the
ones the job's own Python code opened.

A dumped rank must hold no connection of its communicators or rendezvous store (they are
rebuilt after a thaw), so the hook records the sockets that appear while it opens a store
connection or builds a communicator (`Owned.track`), checks after a teardown that no such
socket is left (`tcp_sockets`), and closes its own in every child forked from the rank
(DataLoader workers inherit the rank's fds; a copy there would keep the connection alive in the
dumped process tree).

Connections the job's Python code opened itself, through the `socket` module (an HTTP client
posting metrics, an experiment tracker, TLS included), are the job's business: a snapshot holds
them as they are, and a restore brings them back closed, so the job sees a reset and its client
reconnects (`ForeignSockets`). A leftover TCP socket that is neither ours nor Python's belongs
to torch or another C library: the freeze is refused and names it.

Linux only; stdlib only; never opens a socket.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TcpSocket:
    fd: int
    inode: int
    local: str
    remote: str
    state: str


_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def _addr(hexaddr: str) -> str:
    host, port = hexaddr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:
        # /proc prints IPv6 as four host-order 32-bit words.
        words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
        flat = b"".join(words)
        ip = ":".join(flat[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(port, 16)}"


def _tcp_table(pid: int | str) -> dict[int, tuple[str, str, str]]:
    table: dict[int, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) < 10:
                        continue
                    state = _STATES.get(parts[3], parts[3])
                    table[int(parts[9])] = (_addr(parts[1]), _addr(parts[2]), state)
        except OSError:
            continue
    return table


def socket_inodes(pid: int | str = "self") -> dict[int, int]:
    """fd -> socket inode for every socket fd of `pid` (any family)."""
    out: dict[int, int] = {}
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def tcp_sockets(pid: int | str = "self") -> list[TcpSocket]:
    """Every TCP socket (IPv4 or IPv6, any state) that `pid` holds an fd for."""
    fds = socket_inodes(pid)
    if not fds:
        return []
    table = _tcp_table(pid)
    found = []
    for fd, inode in sorted(fds.items()):
        if inode in table:
            local, remote, state = table[inode]
            found.append(TcpSocket(fd, inode, local, remote, state))
    return found


class Owned:
    """Socket inodes the hook itself opened (store connections, communicators)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inodes: set[int] = set()

    @contextmanager
    def track(self) -> Iterator[None]:
        """Record the sockets that appear in this process while the block runs."""
        before = set(socket_inodes().values())
        try:
            yield
        finally:
            new = set(socket_inodes().values()) - before
            with self._lock:
                self._inodes |= new

    def close_in_child(self) -> None:
        """Close, in a freshly forked child, the fds that point at the hook's sockets."""
        inodes = self._inodes  # no lock: other threads do not exist in the child
        if not inodes:
            return
        for fd, inode in socket_inodes().items():
            if inode in inodes:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def forget_closed(self) -> None:
        """Drop inodes no longer open in this process (after a teardown)."""
        live = set(socket_inodes().values())
        with self._lock:
            self._inodes &= live


class ForeignSockets:
    """Every socket the job's Python code creates (recorded from `socket.socket.__init__`,
    which SSL sockets, socketpair and fromfd also go through), held weakly."""

    def __init__(self) -> None:
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()

    def install(self) -> None:
        real = socket.socket.__init__
        socks, lock = self._socks, self._lock

        def init(sock: socket.socket, *args: object, **kwargs: object) -> None:
            real(sock, *args, **kwargs)  # type: ignore[arg-type]
            with lock:
                socks.add(sock)

        socket.socket.__init__ = init  # type: ignore[method-assign,assignment]

    def fds(self) -> set[int]:
        with self._lock:
            socks = list(self._socks)
        return {fd for s in socks if (fd := _fileno(s)) >= 0}


def _fileno(s: socket.socket) -> int:
    try:
        return s.fileno()
    except OSError:
        return -1
