"""Weight push's directory: which version of each channel is newest, and who pulls from whom.

The bytes never pass through here (agent to agent, agent/weights.py); the coordinator only
keeps, per (tenant, channel), the newest version a rank published, its read ticket, and the
order in which nodes took it. A node that asks for something newer than it holds (a
long-poll, WatchWeights) gets a plan: its parent in a binary tree over that order (the
publisher at the root; index.tree_parent, pure), then the publisher, then a few nodes that
said they hold it whole, as fallbacks. The
publisher's link thus carries each version about twice however many replicas pull, and a
node that joins late simply takes the next place in the tree.

Channels belong to tenants: a node asks on behalf of a job running on it, and sees only the
channels of that job's tenant. Nothing here is kept in the store: a restarted coordinator
learns a channel again at its next publish (replicas keep the version they hold meanwhile).

Watches hold an RPC worker while they wait, so at most `max_waiting` wait at once; the rest
are answered at once with no plan and poll again (agent/weights.py waits a second).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from snapshotter import errors
from snapshotter.v1 import common_pb2
from snapshotter.v1 import coordinator_pb2 as pb
from snapshotter.weights.index import check_channel, tree_order, tree_parent

if TYPE_CHECKING:
    from snapshotter.coordinator.core import Coordinator

MAX_WATCH_S = 30.0
MAX_FALLBACKS = 3


@dataclass
class Channel:
    tenant: str
    name: str
    lineage: str  # the publishing job
    version: int
    token: str
    publisher: str  # its node
    bytes: int = 0
    order: list[str] = field(default_factory=list)  # nodes in the order they took it
    holders: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


class WeightsBoard:
    def __init__(self, c: Coordinator, max_waiting: int = 8) -> None:
        self.c = c
        self.max_waiting = max_waiting
        self._channels: dict[tuple[str, str], Channel] = {}
        self._cond = threading.Condition()
        self._waiting = 0

    def _tenant_on(self, job_id: str, node: str) -> str:
        """The tenant of `job_id`, which must have ranks on `node`.

        Raises: JobNotFound; PermissionDenied if the job does not run there."""
        rec = self.c.job(job_id)
        if node not in rec.agents:
            raise errors.PermissionDenied(
                f"job {job_id} has no ranks on node {node}",
                "a node pulls or publishes weights only for a job running on it",
                right="REGISTER",
            )
        return rec.spec.tenant

    def announce(self, req: pb.AnnounceWeightsRequest) -> common_pb2.Empty:
        from snapshotter.coordinator.core import node_caller

        node_caller(req.node, "announce weights for", "an agent speaks only for its own node")
        key = (self._tenant_on(req.job_id, req.node), check_channel(req.channel))
        with self._cond:
            ch = self._channels.get(key)
            if req.published:
                if req.lineage != req.job_id or req.version < 1 or not req.token:
                    raise errors.InvalidArgument(
                        f"node {req.node} announced version {req.version} of {req.channel!r} "
                        "without its job's lineage or a ticket",
                        "use the same snapshotter version on every node",
                    )
                if ch is None or ch.lineage != req.lineage or req.version > ch.version:
                    self._channels[key] = Channel(*key, req.lineage, req.version, req.token,
                                                  req.node, req.bytes)  # fmt: skip
                    self._cond.notify_all()
            elif ch is not None and (ch.lineage, ch.version) == (req.lineage, req.version):
                (ch.failed if req.failed else ch.holders).add(req.node)
                (ch.holders if req.failed else ch.failed).discard(req.node)
        return common_pb2.Empty()

    def watch(self, req: pb.WatchWeightsRequest) -> pb.WeightsPlan:
        from snapshotter.coordinator.core import node_caller

        node_caller(req.node, "watch weights for", "an agent speaks only for its own node")
        tenant = self._tenant_on(req.job_id, req.node)
        key = (tenant, check_channel(req.channel))
        deadline = time.monotonic() + min(max(req.timeout_s, 0.0), MAX_WATCH_S)
        with self._cond:
            if self._waiting >= self.max_waiting:
                deadline = 0.0  # answer at once: the agent polls
            self._waiting += 1
            try:
                while (ch := self._newer(key, req)) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return pb.WeightsPlan(channel=req.channel, tenant=tenant)
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
            live = self.c.live_agents()  # once a plan is due, not per candidate
            ch.order = tree_order(ch.order, req.node)
            ch.failed.discard(req.node)
            parent = tree_parent(ch.order, req.node,
                                 lambda n: n not in ch.failed and n in live)
            plan = pb.WeightsPlan(channel=ch.name, lineage=ch.lineage, version=ch.version,
                                  token=ch.token, bytes=ch.bytes, tenant=tenant)  # fmt: skip
            # Then a few nodes that hold it whole: for when the publisher is gone or ended.
            others = [n for n in sorted(ch.holders - ch.failed)
                      if n not in (req.node, parent, ch.publisher)][:MAX_FALLBACKS]  # fmt: skip
        for n in ([parent] if parent else []) + [ch.publisher] + others:
            if n in live:
                plan.sources.add(node=n, address=live[n].address)
        return plan

    def _newer(self, key: tuple[str, str], req: pb.WatchWeightsRequest) -> Channel | None:
        ch = self._channels.get(key)
        if ch is None or ch.publisher == req.node:
            return None
        if ch.lineage != req.lineage or ch.version > req.version:
            return ch
        return None

    def listing(self, tenant: str | None) -> pb.WeightsChannelList:
        """Every channel (tenant None: the provider's view) or one tenant's; no tickets."""
        with self._cond:
            chs = sorted(self._channels.values(), key=lambda ch: (ch.tenant, ch.name))
            return pb.WeightsChannelList(channels=[
                pb.WeightsChannel(tenant=ch.tenant, channel=ch.name, lineage=ch.lineage,
                                  version=ch.version, publisher=ch.publisher, bytes=ch.bytes,
                                  holders=sorted(ch.holders), failed=sorted(ch.failed))
                for ch in chs if tenant is None or ch.tenant == tenant])  # fmt: skip
