"""A node's data links: which interface each plane is, whether it is up, and the routes that
carry a failed plane's traffic meanwhile.

A *plane* is one network across the cluster: plane i is the i-th link (`snapshotter agent
--link IFACE`, repeatable) of every node. A job's communicators all use one plane (a gloo pair
joins two addresses of the same network); they start on plane 0, and the coordinator moves
them to another (coordinator/reroute.py) when a link of theirs goes down or is drained.

Moving them means rebuilding the communicators, which needs every rank quiesced, which needs
the collectives in flight on the dead link to finish. `bridge` makes them finish: it routes
each peer's address on the failed plane through that peer's address on a healthy plane, so
that TCP's retransmissions reach it and the collective completes with the values it was
issued with (a local address stays local even on a link that is down, so the peer accepts
them). The routes are host routes tagged with our own protocol number: removing them
(`bridge(..., remove=True)`) and a restarted agent (`clear_bridges`) touch exactly ours.
NCCL over RDMA has no such route: see the README.

Without `--link` a node has one plane, its listen address's interface, and nothing moves.
"""

from __future__ import annotations

import fcntl
import logging
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.agent.netenv import IFNAME_VARS, node_network_env
from snapshotter.v1 import common_pb2

log = logging.getLogger(__name__)

# The rtnetlink protocol our routes carry (rt_protos: 252 is unassigned; a node's own
# routing daemons never touch it, and we never touch theirs).
ROUTE_PROTO = "252"
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_RUNNING = 0x40  # RFC 2863 operational state up: the kernel's carrier


@dataclass(frozen=True)
class Link:
    name: str
    ip: str
    up: bool

    def to_proto(self) -> common_pb2.LinkState:
        return common_pb2.LinkState(name=self.name, ip=self.ip, up=self.up)


def is_up(flags: int) -> bool:
    """Whether a link carries traffic, from its interface flags (pure): administratively up
    and operationally running (its carrier is there)."""
    return bool(flags & _IFF_UP) and bool(flags & _IFF_RUNNING)


def flags_of(name: str) -> int:
    """The interface flags of `name` in this process's network namespace (0: no such
    interface). ioctl, not /sys: sysfs shows the namespace it was mounted in."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", name.encode()[:15], 0)
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req)
        except OSError:
            return 0
    return int(struct.unpack("16sH14x", res)[1])


def ipv4_of(name: str) -> str:
    """The IPv4 address of interface `name` in this network namespace ("" when none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("256s", name.encode()[:15])
        try:
            res = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)
        except OSError:
            return ""
    return socket.inet_ntoa(res[20:24])


def check_links(names: Sequence[str], overrides: Mapping[str, str]) -> None:
    """Refuse a configuration that cannot work. Raises: InvalidArgument naming it."""
    if len(set(names)) != len(names):
        raise errors.InvalidArgument(f"--link names repeat: {', '.join(names)}",
                                     "name each data link once")  # fmt: skip
    for n in names:
        try:
            socket.if_nametoindex(n)
        except OSError as e:
            raise errors.InvalidArgument(
                f"--link {n}: this node has no interface {n!r}",
                "`ip link` lists the node's interfaces",
            ) from e
    clash = sorted(set(overrides) & set(IFNAME_VARS))
    if names and clash:
        raise errors.InvalidArgument(
            f"--link and --env {clash[0]} both choose the ranks' interface",
            "leave the interface to --link (each plane sets every *_SOCKET_IFNAME)",
        )


class Links:
    """This node's data links, in plane order, and their state now."""

    def __init__(self, names: Sequence[str], base_env: Mapping[str, str]) -> None:
        """`base_env`: the node's network settings without --link (its listen address's
        interface and the agent's --env); each plane's interface replaces the former."""
        self.names = tuple(names)
        self.base_env = dict(base_env)

    def env(self, plane: int = 0) -> dict[str, str]:
        """The network settings of this node's ranks on `plane` (a plane this node lacks:
        its first)."""
        if not self.names:
            return dict(self.base_env)
        name = self.names[plane] if 0 <= plane < len(self.names) else self.names[0]
        return {**self.base_env, **node_network_env(name, {})}

    def states(self) -> list[Link]:
        return [Link(n, ipv4_of(n), is_up(flags_of(n))) for n in self.names]

    def bridge(self, plane: int, routes: Sequence[tuple[str, str]], remove: bool) -> None:
        """Route each `dst` via `via` through this node's link of `plane` (or remove those
        routes). Raises: InvalidArgument for a plane this node lacks; RerouteFailed when
        `ip` refuses."""
        dev = self.names[plane] if 0 <= plane < len(self.names) else None
        if dev is None:
            raise errors.InvalidArgument(
                f"this node has no data link of plane {plane}",
                "configure it with `snapshotter agent --link`",
            )
        for dst, via in routes:
            socket.inet_aton(dst), socket.inet_aton(via)  # refuse anything but addresses
            if remove:
                _ip("route", "del", f"{dst}/32", "proto", ROUTE_PROTO, check=False)
            else:
                _ip("route", "replace", f"{dst}/32", "via", via, "dev", dev,
                    "proto", ROUTE_PROTO)  # fmt: skip

    def clear_bridges(self) -> None:
        """Remove every route of ours (an agent that restarted mid-reroute left them)."""
        if self.names:
            _ip("route", "flush", "proto", ROUTE_PROTO, check=False)


def _ip(*args: str, check: bool = True) -> None:
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise errors.RerouteFailed(
            f"ip {' '.join(args)}: {e}", "install iproute2 on the node"
        ) from e
    if check and proc.returncode != 0:
        raise errors.RerouteFailed(
            f"ip {' '.join(args)} failed: {proc.stderr.strip()}",
            "the agent needs CAP_NET_ADMIN in the node's network namespace",
        )


class LinkWatcher:
    """Polls the links' state and calls `on_change(states)` when any changed (from its own
    thread): a heartbeat then tells the coordinator at once, not at the next beat."""

    def __init__(self, links: Links, on_change: Callable[[list[Link]], None],
                 every_s: float = 0.2) -> None:  # fmt: skip
        self.links = links
        self._on_change = on_change
        self._every = every_s
        self._stop = threading.Event()
        self.last = links.states()

    def start(self) -> None:
        if self.links.names:
            threading.Thread(target=self._run, daemon=True, name="links").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            now = self.links.states()
            if now != self.last:
                pairs = zip(self.last, now, strict=True)
                changed = [f"{b.name} {'up' if b.up else 'down'}" for a, b in pairs if a.up != b.up]
                if changed:
                    log.warning("data link(s) %s", ", ".join(changed))
                self.last = now
                try:
                    self._on_change(now)
                except Exception:  # noqa: BLE001 - the watch must go on
                    log.exception("reporting a link change failed")
