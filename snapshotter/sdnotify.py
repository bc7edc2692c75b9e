"""Telling systemd a service is ready or stopping (`Type=notify` units in deploy/systemd/).

The protocol is one datagram of `KEY=VALUE` lines to the unix socket named by NOTIFY_SOCKET
(a leading `@` names an abstract socket). Without NOTIFY_SOCKET (not under systemd) it does
nothing; a failure to send is logged, never raised: a service must not die for a status line.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send `lines` (e.g. "READY=1", "STATUS=serving") to systemd; whether it was sent."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path or not lines:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto("\n".join(lines).encode(), address)
        return True
    except OSError as e:
        log.warning("could not tell systemd %s (NOTIFY_SOCKET=%s): %s", lines, path, e)
        return False
