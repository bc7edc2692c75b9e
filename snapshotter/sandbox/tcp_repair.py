"""Take a dumped tree's TCP sockets out of repair mode before it goes on.

CRIU dumps an established connection (`--tcp-established`) by putting its socket in TCP
repair mode, and takes it out again only when it leaves the tree *running*. A tree it leaves
*stopped* (criu.dump's `while_stopped`: files are copied while nothing writes them) keeps its
sockets in repair mode after CRIU is gone: whatever the job then sends is queued and never
goes out, so its client waits for its own timeout (forever, without one) and reconnects. This
module does what CRIU would have done (repair off, which also sends a window probe), from
outside the job: each socket is borrowed with pidfd_getfd(2), changed, and let go.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import socket
from collections.abc import Iterable

from snapshotter.hook.sockets import tcp_sockets

log = logging.getLogger(__name__)

TCP_REPAIR = 19  # linux/tcp.h
TCP_REPAIR_OFF = 0
SYS_PIDFD_GETFD = 438  # the same number on every architecture (asm-generic, x86_64)
_libc = ctypes.CDLL(None, use_errno=True)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    got = int(_libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0))
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return got


def repair_off(pids: Iterable[int]) -> int:
    """Take every TCP socket of these processes out of repair mode; return how many were in
    it. Best effort: a socket that cannot be changed is logged (its connection stalls until
    the job's client gives up on it), never raised: the dump itself succeeded, and the tree
    must go on whatever happens here."""
    turned = 0
    for pid in pids:
        socks = tcp_sockets(pid)
        if not socks:
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as e:
            if e.errno != errno.ESRCH:
                log.warning("cannot reach the sockets of process %d (%s): its TCP connections "
                            "stay stalled", pid, e)  # fmt: skip
            continue
        try:
            for s in socks:
                try:
                    turned += _off(_pidfd_getfd(pidfd, s.fd))
                except OSError as e:
                    if e.errno not in (errno.EBADF, errno.ESRCH):  # closed, or gone
                        log.warning("could not take socket fd %d of process %d out of TCP "
                                    "repair mode (%s): its connection stays stalled", s.fd, pid,
                                    e)  # fmt: skip
        finally:
            os.close(pidfd)
    return turned


def _off(fd: int) -> int:
    """1 if the TCP socket behind our copy `fd` was in repair mode (now out of it)."""
    with socket.socket(fileno=fd) as s:  # closes our copy only
        if not s.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR):
            return 0
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
        return 1
