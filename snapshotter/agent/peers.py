"""How a job's connections to other nodes fare, read from this node's TCP stack.

The ranks' communicators (gloo pairs) are TCP connections; the kernel keeps, per connection,
its smoothed round-trip time, bytes sent and retransmitted and its delivery rate (what `ss -ti`
prints, from inet_diag). A slowed or lossy link shows there first: queueing in front of a
rate limit raises the RTT of every connection crossing it, loss raises retransmissions. This
module reads them for the ranks' processes without touching the ranks, and sums them per peer
address; the coordinator maps addresses to nodes and judges (coordinator/top_rules.py).

`parse` is pure; `established` runs `ss` once.
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass

# Connections that carried less than this say little about their path: the rendezvous
# store's, or a connection idle since its handshake, whose RTT is that of the handshake.
MIN_BYTES = 1 << 20
SS_TIMEOUT_S = 2.0

_PID = re.compile(r"pid=(\d+)")
_RTT = re.compile(r"\brtt:([\d.]+)/")
_SENT = re.compile(r"\bbytes_sent:(\d+)")
_RETRANS = re.compile(r"\bbytes_retrans:(\d+)")
_RATE = re.compile(r"\bdelivery_rate ([\d.]+)([kMG]?)bps")
_UNIT = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}


@dataclass(frozen=True)
class Conn:
    pid: int
    local: str
    peer: str
    rtt_ms: float
    bytes_sent: int
    bytes_retrans: int
    delivery_bps: float


@dataclass
class Peer:
    address: str
    connections: int = 0
    rtt_ms: float = 0.0  # the worst of its connections
    bytes_sent: int = 0
    bytes_retrans: int = 0
    delivery_bps: float = 0.0  # the lowest of its connections (0: none said)


def _host(endpoint: str) -> str:
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    return host.removeprefix("::ffff:")


def parse(text: str) -> list[Conn]:
    """The connections in `ss -tinpH state established` output (one header line, then one
    indented line of TCP details, per connection)."""
    out: list[Conn] = []
    head: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            head = line.split()
            continue
        if head is None or len(head) < 4:
            continue
        fields, head = head, None
        pid = _PID.search(" ".join(fields[4:]))
        rtt = _RTT.search(line)
        if pid is None or rtt is None:
            continue
        sent, retrans, rate = _SENT.search(line), _RETRANS.search(line), _RATE.search(line)
        out.append(Conn(
            pid=int(pid.group(1)), local=_host(fields[2]), peer=_host(fields[3]),
            rtt_ms=float(rtt.group(1)), bytes_sent=int(sent.group(1)) if sent else 0,
            bytes_retrans=int(retrans.group(1)) if retrans else 0,
            delivery_bps=float(rate.group(1)) * _UNIT[rate.group(2)] if rate else 0.0,
        ))  # fmt: skip
    return out


def _remote(c: Conn) -> bool:
    try:
        if ipaddress.ip_address(c.peer).is_loopback:
            return False
    except ValueError:
        return False
    return c.peer != c.local


def by_peer(conns: Iterable[Conn], pids: set[int], min_bytes: int = MIN_BYTES) -> list[Peer]:
    """The connections of processes `pids` to other nodes that carried `min_bytes`, per peer
    address, in address order."""
    peers: dict[str, Peer] = {}
    for c in conns:
        if c.pid not in pids or c.bytes_sent < min_bytes or not _remote(c):
            continue
        p = peers.setdefault(c.peer, Peer(c.peer))
        p.connections += 1
        p.rtt_ms = max(p.rtt_ms, c.rtt_ms)
        p.bytes_sent += c.bytes_sent
        p.bytes_retrans += c.bytes_retrans
        if c.delivery_bps > 0:
            p.delivery_bps = min(p.delivery_bps or c.delivery_bps, c.delivery_bps)
    return [peers[k] for k in sorted(peers)]


def established() -> list[Conn]:
    """This node's established TCP connections, from one run of `ss` ([] when it fails:
    telemetry is best effort and never fails a progress sample)."""
    try:
        done = subprocess.run(
            ["ss", "-tinpH", "state", "established"],
            capture_output=True, text=True, timeout=SS_TIMEOUT_S, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse(done.stdout) if done.returncode == 0 else []


def collect(pids: set[int], conns: list[Conn] | None = None) -> list[Peer]:
    """This node's view of the connections of `pids` to other nodes, from `conns` when the
    caller read them once for several jobs (a metrics scrape), else from a run of `ss`."""
    if not pids:
        return []
    return by_peer(established() if conns is None else conns, pids)
