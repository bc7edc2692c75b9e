"""The network settings a node's ranks must use, found from the node's own address.

Communicator libraries pick their interface from environment variables read when a
communicator is created (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, TP_SOCKET_IFNAME). A rank
thawed on another node would otherwise keep the old node's values, and a name that does not
exist there kills the rebuild; so each agent hands its own values to its ranks at launch and
at every resume (launch/env.py: the node's values win).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915


def node_network_env(ifname: str | None, overrides: Mapping[str, str]) -> dict[str, str]:
    """The variables for an interface, with explicit settings winning (pure)."""
    env = {v: ifname for v in IFNAME_VARS} if ifname else {}
    env.update(overrides)
    return env


def interface_of(ip: str) -> str | None:
    """The name of this network namespace's interface holding IPv4 address `ip`, if any."""
    try:
        if not ip or ipaddress.ip_address(ip).is_unspecified:  # the wildcard has no interface
            return None
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(res[20:24]) == ip:
                return name
    return None
