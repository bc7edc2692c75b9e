"""Link probes for the cluster audit: one node listens on one of its data links for exactly
one connection, a peer connects over that link and measures it.

The listener is mutual TLS with the nodes' certificates (the prober must present the
certificate of the node the coordinator named, and the listener's must match the name the
prober expects), then a one-time token the coordinator gave both; it accepts one connection
and closes within PROBE_WINDOW_S. Without TLS (a development node) it listens only on a
loopback address.

On the wire, after the token: PINGS round trips of 64 bytes ("P" + 63), then "B" + the length
(8 bytes) + that many bytes, answered with the 8-byte count the listener read. Throughput is
the length over the time from the first byte sent to the answer; retransmissions come from
the prober's socket (TCP_INFO: total_retrans / segs_out).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import statistics
import struct
import threading
import time
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.rpc.server import is_loopback
from snapshotter.rpc.tls import TlsFiles

log = logging.getLogger(__name__)
PROBE_WINDOW_S = 60.0
PINGS = 20
MAX_BYTES = 1 << 30
_PIECE = 1 << 20
_TCP_INFO_RETRANS = 100  # offsetof(struct tcp_info, tcpi_total_retrans)
_TCP_INFO_SEGS_OUT = 136  # offsetof(struct tcp_info, tcpi_segs_out)


@dataclass(frozen=True)
class Measured:
    rtt_ms: float
    mbps: float
    retrans: float


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the peer closed the probe early")
        out += chunk
    return bytes(out)


def _server_context(tls: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.load_verify_locations(str(tls.ca))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _client_context(tls: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    ctx.load_verify_locations(str(tls.ca))
    return ctx


def _names(cert: dict) -> tuple[str, str]:  # type: ignore[type-arg]
    subject = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
    return subject.get("commonName", ""), subject.get("organizationalUnitName", "")


def open_listener(ip: str, token: str, peer: str, tls: TlsFiles | None) -> int:
    """Listen on `ip` for the one probe from node `peer`; return the port.

    Raises: PermissionDenied without TLS on an address beyond loopback."""
    if tls is None and not is_loopback(ip):
        raise errors.PermissionDenied(
            f"a probe listener on {ip} needs TLS and this agent has none",
            "run the agents with --tls-dir (the audit probes links with their certificates)",
            right="DRIVE",
        )
    if len(token) < 32:
        raise errors.InvalidArgument("a probe token is too short", "use the coordinator's")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, 0))
    sock.listen(1)
    sock.settimeout(PROBE_WINDOW_S)
    ctx = _server_context(tls) if tls is not None else None
    threading.Thread(target=_serve_one, args=(sock, ctx, token, peer), daemon=True,
                     name=f"probe-{peer}").start()  # fmt: skip
    return int(sock.getsockname()[1])


def _serve_one(sock: socket.socket, ctx: ssl.SSLContext | None, token: str, peer: str) -> None:
    deadline = time.monotonic() + PROBE_WINDOW_S
    try:
        conn, addr = sock.accept()
    except OSError as e:
        log.warning("link probe from %s never came (%s)", peer, e)
        sock.close()
        return
    sock.close()  # one connection only
    try:
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        if ctx is not None:
            conn = ctx.wrap_socket(conn, server_side=True)
            cn, ou = _names(conn.getpeercert() or {})
            if (cn, ou) != (peer, "node"):
                raise PermissionError(f"the prober is {cn!r} ({ou!r}), not node {peer!r}")
        if not secrets.compare_digest(_recv_exact(conn, len(token)), token.encode()):
            raise PermissionError("wrong probe token")
        while True:
            kind = _recv_exact(conn, 1)
            if kind == b"P":
                conn.sendall(b"P" + _recv_exact(conn, 63))
            elif kind == b"B":
                (n,) = struct.unpack("!Q", _recv_exact(conn, 8))
                if n > MAX_BYTES:
                    raise ValueError(f"a probe of {n} bytes")
                got = 0
                while got < n:
                    chunk = conn.recv(min(_PIECE, n - got))
                    if not chunk:
                        raise ConnectionError("the prober closed mid-transfer")
                    got += len(chunk)
                conn.sendall(struct.pack("!Q", got))
                return
            else:
                raise ValueError(f"unknown probe message {kind!r}")
    except (OSError, ValueError) as e:  # PermissionError, ConnectionError, SSLError too
        log.warning("link probe from %s (%s): %s", peer, addr[0], e)
    finally:
        conn.close()


def probe(address: str, port: int, token: str, peer: str, nbytes: int, source_ip: str,
          tls: TlsFiles | None) -> Measured:  # fmt: skip
    """Connect to `peer`'s listener from `source_ip` and measure the link.

    Raises: OSError / ssl.SSLError / ConnectionError when the probe cannot be made."""
    nbytes = max(1, min(nbytes, MAX_BYTES))
    source = (source_ip, 0) if source_ip else None
    raw = socket.create_connection((address, port), timeout=PROBE_WINDOW_S,
                                   source_address=source)  # fmt: skip
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s: socket.socket = raw
    try:
        if tls is not None:
            s = _client_context(tls).wrap_socket(raw, server_hostname=peer)
        s.sendall(token.encode())
        rtts = []
        ping = b"P" + os.urandom(63)
        for _ in range(PINGS):
            t = time.perf_counter()
            s.sendall(ping)
            if _recv_exact(s, 64) != ping:
                raise ConnectionError("the peer echoed something else")
            rtts.append((time.perf_counter() - t) * 1e3)
        before = _tcp_counts(s)
        data = memoryview(os.urandom(min(_PIECE, nbytes)))
        t = time.perf_counter()
        s.sendall(b"B" + struct.pack("!Q", nbytes))
        sent = 0
        while sent < nbytes:
            piece = data[: min(len(data), nbytes - sent)]
            s.sendall(piece)
            sent += len(piece)
        (got,) = struct.unpack("!Q", _recv_exact(s, 8))
        seconds = time.perf_counter() - t
        if got != nbytes:
            raise ConnectionError(f"the peer read {got} of {nbytes} bytes")
        after = _tcp_counts(s)
        segs = max(1, after[1] - before[1])
        return Measured(statistics.median(rtts), nbytes / seconds / 1e6,
                        max(0, after[0] - before[0]) / segs)  # fmt: skip
    finally:
        s.close()


def _tcp_counts(s: socket.socket) -> tuple[int, int]:
    """(total retransmitted segments, segments sent) of a TCP socket."""
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _TCP_INFO_SEGS_OUT + 4:
        return 0, 0
    (retrans,) = struct.unpack_from("I", info, _TCP_INFO_RETRANS)
    (segs,) = struct.unpack_from("I", info, _TCP_INFO_SEGS_OUT)
    return int(retrans), int(segs)
