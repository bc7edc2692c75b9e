"""Fan-outs as a tree: the coordinator signs one phase call for a group of nodes and hands it
to one of them (the relay), which delivers it to each and answers with every node's outcome.

Why: each phase of a freeze is a call on every node, and at 2,048 nodes that was 2,048
messages through the coordinator's Python gRPC, 0.15-0.3 ms of its CPU each: one process
sending them all cannot meet a second for the five control phases (bench/scale_bench.py).
In groups of about sqrt(N) nodes, the coordinator sends one message per group and each relay
one per member, the relays in parallel on their own nodes.

    coordinator --Relay{order, signature, targets}--> relay agent
                                                      --Relayed{order, signature}--> member
                                                      <--ControlReply{reply | error}--
                <--RelayReply{each member's outcome}--

Trust: a relay is a node agent (role node), and nodes may not drive each other. The call it
delivers stays the coordinator's: the coordinator makes an Ed25519 key when it starts and
hands its public half to each agent in the reply to its registration (over the agent's
mutual-TLS channel to the coordinator). A node runs a relayed call only when
  - the coordinator's current key signed the order (a relay cannot forge or alter it),
  - the node is among the order's targets (it cannot be turned on other nodes),
  - the order has not expired and its nonce is new to the node (it cannot be replayed),
  - the method is one of RELAYED, and its fence passes as a direct call's would.
A relay can still drop or delay a call, as it could its own node's. Every member the relay
did not deliver to (unreachable, or refusing the order before running it: an earlier
release, a key not learnt yet) is called directly by the coordinator, and so is a whole group
whose relay failed.
"""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError

from snapshotter import errors
from snapshotter.rpc import status
from snapshotter.rpc.aio import LOOP, AioClient
from snapshotter.rpc.client import Target
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import agent_pb2, agent_pb2_grpc

# The calls a coordinator may relay: a freeze's control phases, one request for every node.
# Not Dump, Upload or Restore (data phases, long and per node) and not Abort (an undo goes
# straight to every node, relays or not).
RELAYED = frozenset({"Prepare", "Park", "Suspend", "Resume", "FinishFreeze"})
# An order stays valid this long past its call's own deadline (clocks of nodes differ).
SLACK_S = 120.0
# The longest an order may be valid: what bounds the nonces a node remembers.
MAX_VALID_S = 3600.0
# Fan-outs smaller than this go straight to every node (a relay adds a hop for nothing).
DEFAULT_MIN_AGENTS = 256
# The most nodes one relay delivers an order to.
MAX_TARGETS = 1024
_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["Agent"]


def min_agents() -> int:
    """The smallest fan-out relayed: SNAPSHOTTER_RELAY_MIN (0 turns relaying off)."""
    raw = os.environ.get("SNAPSHOTTER_RELAY_MIN", "")
    try:
        n = int(raw) if raw else DEFAULT_MIN_AGENTS
    except ValueError:
        n = DEFAULT_MIN_AGENTS
    return n if n > 0 else 1 << 62


def groups(n: int) -> list[range]:
    """`n` nodes cut into consecutive groups of about sqrt(n) (pure): the coordinator's and
    each relay's messages per phase are then both about sqrt(n)."""
    if n <= 0:
        return []
    size = max(2, math.isqrt(n - 1) + 1)
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class Signer:
    """The coordinator's relay key: made when it starts, never written anywhere."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    def sign(self, method: str, request: bytes, timeout_s: float, fence: str,
             targets: Sequence[str], now: float | None = None) -> tuple[bytes, bytes]:  # fmt: skip
        """(order, signature) for `method` with the serialized `request` on `targets`."""
        now = time.time() if now is None else now
        order = agent_pb2.RelayOrder(
            method=method, request=request, timeout_s=timeout_s, fence=fence,
            targets=list(targets), expires=now + min(timeout_s + SLACK_S, MAX_VALID_S),
            nonce=secrets.token_bytes(16),
        ).SerializeToString()  # fmt: skip
        return order, self._key.sign(order)


class Trust:
    """What a node accepts from relays: orders its coordinator's key signed, for it, once."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._key: Ed25519PublicKey | None = None
        self._raw = b""
        self._lock = threading.Lock()
        self._seen: dict[bytes, float] = {}  # nonce -> when its order expires

    def learn(self, raw: bytes) -> None:
        """The key a registration reply carried (from the coordinator this node follows)."""
        if not raw or raw == self._raw:
            return
        key = Ed25519PublicKey.from_public_bytes(raw)
        with self._lock:
            self._key, self._raw = key, raw

    def admit(self, order: bytes, signature: bytes,
              now: float | None = None) -> agent_pb2.RelayOrder:  # fmt: skip
        """The order, if this node may run it. Raises: Unauthenticated (no key yet, a bad
        signature), PermissionDenied (not a target, a method that is not relayed),
        InvalidArgument (expired, replayed, malformed)."""
        now = time.time() if now is None else now
        with self._lock:
            key = self._key
        if key is None:
            raise errors.Unauthenticated(
                f"node {self.name} has no relay key from its coordinator yet",
                "the coordinator calls this node directly; its next heartbeat brings the key",
            )
        try:
            key.verify(signature, order)
        except InvalidSignature:
            raise errors.Unauthenticated(
                "a relayed call was not signed by this node's coordinator",
                "the coordinator calls this node directly (a newer coordinator's key arrives "
                "with the next heartbeat)",
            ) from None
        try:
            o = agent_pb2.RelayOrder.FromString(order)
        except DecodeError as e:
            raise errors.InvalidArgument(f"malformed relay order: {e}", "upgrade") from e
        if self.name not in o.targets:
            raise errors.PermissionDenied(
                f"a relayed {o.method[:64]} is not addressed to node {self.name}",
                "deliver an order only to the nodes it names",
            )
        if o.method not in RELAYED:
            raise errors.PermissionDenied(
                f"{o.method[:64]!r} may not be relayed (only {', '.join(sorted(RELAYED))})",
                "call it directly",
            )
        if not now <= o.expires <= now + MAX_VALID_S:
            raise errors.InvalidArgument(
                f"a relayed {o.method} expired {now - o.expires:.0f} s ago (or is not due)",
                "the coordinator calls this node directly; check the nodes' clocks (NTP)",
            )
        with self._lock:
            if o.nonce in self._seen:
                raise errors.InvalidArgument(
                    f"a relayed {o.method} was delivered twice to node {self.name}",
                    "a replay is refused: the coordinator's own call is a new order",
                )
            if len(self._seen) > 1024:
                self._seen = {n: t for n, t in self._seen.items() if t >= now}
            self._seen[o.nonce] = o.expires
        return o


async def deliver(
    req: agent_pb2.RelayRequest,
    call: Callable[[agent_pb2.RelayTarget, agent_pb2.RelayedCall, float], Any],
    timeout_s: float,
) -> agent_pb2.RelayReply:
    """A relay's part: the order to every target at once; each target's outcome. `call(target,
    relayed, timeout)` is the Relayed call (a coroutine returning its ControlReply)."""
    relayed = agent_pb2.RelayedCall(order=req.order, signature=req.signature)
    loop = asyncio.get_running_loop()

    async def one(t: agent_pb2.RelayTarget) -> agent_pb2.RelayResult:
        t0 = loop.time()
        try:
            rep = await call(t, relayed, timeout_s)
        except Exception as e:  # noqa: BLE001 - the target's outcome
            err = status.error_detail(status.as_snapshotter_error(e))
            # Refused, unreachable or gone before its deadline: it did not run (or its agent
            # is gone), and the coordinator calls it directly. Past its deadline it may have
            # run: that failure is its answer (the coordinator must not run it twice).
            late = loop.time() - t0 >= timeout_s * 0.99
            return agent_pb2.RelayResult(name=t.name, error=err, delivered=late)
        if rep.HasField("error"):
            return agent_pb2.RelayResult(name=t.name, error=rep.error, delivered=True)
        return agent_pb2.RelayResult(name=t.name, reply=rep.reply, delivered=True)

    results = await asyncio.gather(*(one(t) for t in req.targets))
    return agent_pb2.RelayReply(results=results)


class Relayer:
    """A node agent's side of Relay: delivers orders to other nodes' agents over mutual TLS
    (this node's certificate; each target's checked against the name it is given), each
    target's calls carried by one Control stream, as the coordinator's are (a new call per
    delivery cost the relays four times the coordinator's message per node).

    A relay serves the same group phase after phase (the groups follow the job's nodes), so
    its channels and streams are kept; the least recently used are closed past MAX_CLIENTS
    and any unused for IDLE_S, which bounds the streams this node holds open on others (each
    holds a thread of the other node's agent)."""

    MAX_CLIENTS = 256
    IDLE_S = 600.0

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls
        # (name, address) -> its client and when it was last used, least recently first.
        self._clients: dict[tuple[str, str], tuple[AioClient, float]] = {}
        self._lock = threading.Lock()

    def _client(self, t: agent_pb2.RelayTarget) -> AioClient:
        key = (t.name, t.address)
        now = time.monotonic()
        with self._lock:
            # Oldest first: close those unused too long, and the oldest past the bound.
            while self._clients:
                oldest, (c, used) = next(iter(self._clients.items()))
                if oldest == key or (now - used < self.IDLE_S
                                     and len(self._clients) < self.MAX_CLIENTS):  # fmt: skip
                    break
                del self._clients[oldest]
                c.close()
            found = self._clients.pop(key, None)
            if found is None:
                target = Target(t.address, tls=self._tls, server_name=t.name)
                client = AioClient(target, agent_pb2_grpc.AgentStub, "agent", "agent", _SERVICE)
            else:
                client = found[0]
            self._clients[key] = (client, now)  # now the most recently used
            return client

    async def relay_async(self, req: agent_pb2.RelayRequest) -> agent_pb2.RelayReply:
        """Every target's outcome (on the event loop that owns this relayer's channels)."""
        if len(req.targets) > MAX_TARGETS:
            raise errors.InvalidArgument(
                f"a relay order for {len(req.targets)} nodes (at most {MAX_TARGETS})",
                "cut the fan-out into smaller groups",
            )

        async def call(t: agent_pb2.RelayTarget, relayed: agent_pb2.RelayedCall,
                       timeout: float) -> Any:  # fmt: skip
            return await self._client(t).call("Relayed", relayed, timeout)

        return await deliver(req, call, order_timeout(req.order) + 5.0)

    def relay(self, req: agent_pb2.RelayRequest) -> agent_pb2.RelayReply:
        """Every target's outcome (from a thread of the gRPC server: on the process's loop)."""
        return LOOP.run(self.relay_async(req))

    def close(self) -> None:
        with self._lock:
            for c, _ in self._clients.values():
                c.close()
            self._clients.clear()


def order_timeout(order: bytes) -> float:
    """The per-node deadline an order carries (what a relay waits for each delivery), read
    before it is trusted: only the relay's own waiting depends on it, bounded here."""
    try:
        t = agent_pb2.RelayOrder.FromString(order).timeout_s
    except DecodeError:
        return 10.0
    return t if math.isfinite(t) and 0 < t <= MAX_VALID_S else 10.0
