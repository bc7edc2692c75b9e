"""The agent's side of weight push: hold versions of channels, serve them to other nodes'
agents, and pull newer ones for the ranks here that subscribed.

Every version this node holds is a file in shared memory with its index beside it:

    <root>/<tenant>/<channel>/<lineage>-<version>.bin   the tensors, page-aligned
                              <lineage>-<version>.json  their index (weights/index.py)
                              current                   {"lineage","version","data","index"}

A rank here publishes (spool op "publish"): the agent hashes its staged tensors in the
rank's memfd, tells the coordinator (AnnounceWeights) with a fresh read ticket, copies them
into the version's file (serving each to peers once copied), then writes the index and
points `current` at it. A rank subscribes (spool op
"subscribe"): the agent follows the channel, and a rank reads `current` itself between its
generation steps (weights/__init__.py), so a rank never waits on the network.

Following is a long-poll of the coordinator (WatchWeights) for a newer version. Its plan
names a tree parent and the publisher. The pull takes the new index from the first that
answers, copies the tensors whose digest did not change from the version held here, and
reads the rest (ReadWeights), from the parent first and from the publisher for whatever the
parent did not deliver (it died, stalled, or sent bytes that do not match their digest).
A version being pulled is served to this node's own children at once, tensor by tensor as
each arrives and checks out (a pipelined tree), and becomes `current` only when whole.

    Version states:  PULLING ──all tensors verified──▶ HELD ──two newer held──▶ (deleted)
                        │                             └─unused here KEEP_ENDED_S, or not
                        │                               the newest once unused──▶ (deleted)
                        │
                        └─no source delivered─▶ FAILED (deleted; the coordinator is told)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import xxhash

from snapshotter import errors, metrics
from snapshotter.checkpoint import spool
from snapshotter.rpc.client import Target, agent_client
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import agent_pb2, common_pb2
from snapshotter.v1 import coordinator_pb2 as cpb
from snapshotter.weights.index import Entry, Index, changed, check_channel, new_index, parse_index

log = logging.getLogger(__name__)
PIECE = 4 << 20
KEEP_HELD = 2
# How long a node keeps the newest version of a channel that no job on it uses any more.
KEEP_ENDED_S = 3600.0
WATCH_S = 15.0
# How long a reader waits for a tensor its source is still pulling before it gives up on
# that source (and pulls from the publisher instead).
STALL_S = 30.0
_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Registry(Protocol):
    """The coordinator's weights board, over RPC or in the same process (embedded)."""

    def announce(self, req: cpb.AnnounceWeightsRequest) -> Any: ...

    def watch(self, req: cpb.WatchWeightsRequest) -> cpb.WeightsPlan: ...


class RpcRegistry:
    def __init__(self, stub: Any) -> None:
        self.stub = stub

    def announce(self, req: cpb.AnnounceWeightsRequest) -> Any:
        return self.stub.AnnounceWeights(req, timeout=10)

    def watch(self, req: cpb.WatchWeightsRequest) -> cpb.WeightsPlan:
        return self.stub.WatchWeights(req, timeout=req.timeout_s + 10)


def _part(name: str) -> str:
    """A path component for a tenant or lineage name (they come from peers)."""
    if _SAFE.match(name):
        return name
    return "x" + xxhash.xxh3_64_hexdigest(name.encode())


@dataclass
class Version:
    """One version on this node: PULLING (some tensors ready) or HELD (all of them)."""

    index: Index
    data: Path
    token: str
    ready: set[str] = field(default_factory=set)
    held: bool = False
    failed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def key(self) -> tuple[str, int]:
        return self.index.lineage, self.index.version

    def mark(self, name: str) -> None:
        with self.cond:
            self.ready.add(name)
            self.cond.notify_all()

    def end(self, held: bool) -> None:
        with self.cond:
            self.held, self.failed = held, not held
            self.cond.notify_all()

    def wait_ready(self, name: str, timeout: float) -> None:
        """Raises: StorageUnavailable if the tensor did not arrive here in time."""
        with self.cond:
            if not self.cond.wait_for(lambda: name in self.ready or self.failed, timeout):
                raise errors.StorageUnavailable(
                    f"tensor {name!r} of version {self.index.version} did not arrive here "
                    f"in {timeout:.0f} s", "the reader pulls it from the publisher instead")
            if name not in self.ready:
                raise errors.StorageUnavailable(
                    f"this node failed to get version {self.index.version}",
                    "the reader pulls it from the publisher instead")


class WeightsHub:
    def __init__(self, root: Path, node: str, peer_tls: TlsFiles | None = None) -> None:
        self.root = root
        self.node = node
        self.peer_tls = peer_tls
        self.registry: Registry | None = None
        self._versions: dict[tuple[str, str], list[Version]] = {}  # oldest first
        self._following: dict[tuple[str, str], set[str]] = {}  # -> subscribing jobs here
        self._idle_since: dict[tuple[str, str], float] = {}  # no job here uses it since
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._clients: dict[tuple[str, str], Any] = {}  # (node, address) -> its agent's client
        self.pulled = 0  # versions pulled whole (for tests and metrics)
        self.fetched_bytes = 0  # bytes that came over the network

    def attach(self, registry: Registry) -> None:
        self.registry = registry

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- the ranks here (spool ops) ---------------------------------------------------------

    def handle(self, job_id: str, tenant: str, request: spool.Request,
               open_fd: Callable[[int], int]) -> dict[str, Any]:  # fmt: skip
        key = (tenant, check_channel(request.name))
        if request.op == "subscribe":
            self._follow(key, job_id)
            return {"ok": True, "dir": str(self._dir(key))}
        return self._publish(key, job_id, request, open_fd)

    def _publish(self, key: tuple[str, str], job_id: str, request: spool.Request,
                 open_fd: Callable[[int], int]) -> dict[str, Any]:  # fmt: skip
        started = time.monotonic()
        meta = request.meta or {}
        tensors = meta.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, dict) for t in tensors):
            raise errors.InvalidArgument("weights publish lists no tensors", spool._UPGRADE)
        version = meta.get("version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise errors.InvalidArgument("weights publish names no version", spool._UPGRADE)
        ix = new_index(key[1], job_id, version,
                       [(t.get("name"), t.get("dtype"), t.get("shape")) for t in tensors])  # type: ignore[misc]  # fmt: skip
        if len(request.extents) != len(ix.entries) or any(
            x.length != e.length for x, e in zip(request.extents, ix.entries, strict=True)
        ):
            raise errors.InvalidArgument("weights publish extents do not match its tensors",
                                         spool._UPGRADE)  # fmt: skip
        newest = self.newest(key)
        if newest is not None and newest.key >= (job_id, version) and newest.key[0] == job_id:
            raise errors.InvalidArgument(
                f"version {version} of {key[1]!r} is not newer than {newest.index.version}",
                "publish versions that count up",
            )
        fds: dict[int, int] = {}
        v: Version | None = None
        try:
            for x in request.extents:
                if x.fd not in fds:
                    fds[x.fd] = open_fd(x.fd)
            sources = [(fds[x.fd], x.offset) for x in request.extents]
            # The digests first (one read of the slot): the version is then announced and
            # pulled while its bytes are still being copied here (a peer's read waits for
            # each tensor, Version.wait_ready), which takes the copy off the push's latency.
            ix = ix.with_digests(_digests(sources, ix.entries))
            v = self._begin(key, ix, secrets.token_hex(16))
            self._announce(cpb.AnnounceWeightsRequest(
                node=self.node, job_id=job_id, channel=key[1], lineage=job_id, version=version,
                token=v.token, published=True, bytes=ix.size,
                tensors=len(ix.entries)))  # fmt: skip
            _copy_in(v, sources)
        except BaseException:
            if v is not None:
                self._drop(key, v)
            raise
        finally:
            for fd in fds.values():
                os.close(fd)
        self._hold(key, v)
        metrics.WEIGHTS_VERSIONS.labels("published").inc()
        metrics.WEIGHTS_BYTES.labels("published").inc(ix.size)
        return {**spool.ok(ix.size, ix.size, 0, time.monotonic() - started), "version": version}

    def _announce(self, req: cpb.AnnounceWeightsRequest) -> None:
        if self.registry is None:
            return  # no coordinator (a node on its own): the ranks here still see it
        try:
            self.registry.announce(req)
        except errors.SnapshotterError as e:
            # The version is held and served here either way; replicas elsewhere learn of
            # the next one (the coordinator keeps only the newest).
            log.warning("could not announce weights %s v%d: %s", req.channel, req.version, e)

    # ---- versions held here -----------------------------------------------------------------

    def _dir(self, key: tuple[str, str]) -> Path:
        return self.root / _part(key[0] or "_") / key[1]

    def newest(self, key: tuple[str, str]) -> Version | None:
        with self._cond:
            held = [v for v in self._versions.get(key, []) if v.held]
        return held[-1] if held else None

    def _begin(self, key: tuple[str, str], ix: Index, token: str) -> Version:
        d = self._dir(key)
        d.mkdir(parents=True, exist_ok=True, mode=0o711)
        for p in (self.root, d.parent):
            os.chmod(p, 0o711)
        data = d / f"{_part(ix.lineage)}-{ix.version}.bin"
        with open(data, "wb") as f:
            f.truncate(ix.size)
        os.chmod(data, 0o644)
        v = Version(ix, data, token)
        with self._cond:
            self._versions.setdefault(key, []).append(v)
            self._cond.notify_all()
        return v

    def _hold(self, key: tuple[str, str], v: Version) -> None:
        """v is whole: write its index, make it `current`, drop what is older than KEEP_HELD."""
        index_path = v.data.with_suffix(".json")
        _write(index_path, v.index.to_json())
        _write(self._dir(key) / "current", json.dumps({
            "lineage": v.index.lineage, "version": v.index.version,
            "data": str(v.data), "index": str(index_path)}).encode())  # fmt: skip
        v.end(held=True)
        with self._cond:
            vs = self._versions.get(key, [])
            held = [x for x in vs if x.held]
            old = held[:-KEEP_HELD]
            self._versions[key] = [x for x in vs if x not in old]
        for x in old:
            _unlink(x)

    def _drop(self, key: tuple[str, str], v: Version) -> None:
        v.end(held=False)
        with self._cond:
            vs = self._versions.get(key, [])
            if v in vs:
                vs.remove(v)
        _unlink(v)

    def _find(self, key: tuple[str, str], lineage: str, version: int,
              timeout: float) -> Version | None:  # fmt: skip
        """The version, waiting a little for it to appear (a child may ask its parent before
        the parent's own plan arrived)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for v in self._versions.get(key, []):
                    if v.key == (lineage, version) and not v.failed:
                        return v
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return None
                self._cond.wait(left)

    # ---- other nodes' agents (ReadWeights, WeightsIndex) ------------------------------------

    def _served(self, req: agent_pb2.WeightsRequest) -> Version:
        key = (req.tenant, check_channel(req.channel))
        v = self._find(key, req.lineage, req.version, timeout=10.0)
        if v is None:
            raise errors.StorageUnavailable(
                f"node {self.node} holds no version {req.version} of {req.channel!r}",
                "pull it from the publisher",
            )
        if not secrets.compare_digest(v.token.encode(), req.token.encode()):
            raise errors.PermissionDenied(
                f"wrong ticket for version {req.version} of {req.channel!r}",
                "only nodes the coordinator's plan names may read it", right="TRANSFER",
            )  # fmt: skip
        return v

    def index_of(self, req: agent_pb2.WeightsRequest) -> agent_pb2.WeightsIndexReply:
        return agent_pb2.WeightsIndexReply(index=self._served(req).index.to_json())

    def read(self, req: agent_pb2.WeightsRequest) -> Iterator[agent_pb2.WeightPiece]:
        v = self._served(req)
        entries = v.index.by_name()
        wanted = []
        for name in req.names:
            if name not in entries:
                raise errors.InvalidArgument(f"version {req.version} has no tensor {name!r}",
                                             "ask for tensors its index lists")  # fmt: skip
            wanted.append(entries[name])
        fd = os.open(v.data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for e in wanted:
                v.wait_ready(e.name, STALL_S)
                first = True
                for off in range(0, max(e.length, 1), PIECE):
                    n = min(PIECE, e.length - off)
                    data = os.pread(fd, n, e.offset + off) if n > 0 else b""
                    yield agent_pb2.WeightPiece(name=e.name if first else "", data=data)
                    metrics.WEIGHTS_BYTES.labels("served").inc(len(data))
                    first = False
        finally:
            os.close(fd)

    # ---- following a channel for the ranks here ---------------------------------------------

    def _follow(self, key: tuple[str, str], job_id: str) -> None:
        with self._cond:
            jobs = self._following.get(key)
            if jobs is not None:
                jobs.add(job_id)
                return
            self._following[key] = {job_id}
        self._dir(key).mkdir(parents=True, exist_ok=True, mode=0o711)
        threading.Thread(target=self._watch, args=(key,), daemon=True,
                         name=f"weights-{key[1]}").start()  # fmt: skip

    def prune(self, live_jobs: set[str], now: float | None = None) -> None:
        """Stop following for jobs that ended here (housekeeping). A channel nobody here
        follows or publishes any more keeps its newest version for KEEP_ENDED_S, to serve
        replicas that join late (also after the trainer ended) and peers that pull it;
        then it is deleted."""
        now = time.monotonic() if now is None else now
        with self._cond:
            for key in list(self._following):
                self._following[key] &= live_jobs
                if not self._following[key]:
                    del self._following[key]
            idle = {k for k, vs in self._versions.items()
                    if k not in self._following and all(v.index.lineage not in live_jobs
                                                        for v in vs)}  # fmt: skip
            for k in list(self._idle_since):
                if k not in idle:
                    del self._idle_since[k]
            dropped: list[Version] = []
            gone = []
            for k in idle:
                since = self._idle_since.setdefault(k, now)
                vs = self._versions[k]
                held = [v for v in vs if v.held]
                keep = held[-1:] if now - since < KEEP_ENDED_S else []
                dropped += [v for v in vs if v not in keep]
                if keep:
                    self._versions[k] = keep
                else:
                    gone.append(k)
                    del self._versions[k], self._idle_since[k]
        for v in dropped:
            v.end(held=False)
            _unlink(v)
        for k in gone:
            shutil.rmtree(self._dir(k), ignore_errors=True)

    def _watch(self, key: tuple[str, str]) -> None:
        while not self._stop.is_set():
            with self._cond:
                jobs = self._following.get(key)
                job_id = min(jobs) if jobs else None
            if job_id is None:
                return
            if self.registry is None:
                self._stop.wait(1.0)
                continue
            held = self.newest(key)
            lineage, version = held.key if held is not None else ("", 0)
            try:
                plan = self.registry.watch(cpb.WatchWeightsRequest(
                    node=self.node, job_id=job_id, channel=key[1], lineage=lineage,
                    version=version, timeout_s=WATCH_S))  # fmt: skip
            except errors.SnapshotterError as e:
                log.warning("watching weights %s: %s", key[1], e)
                self._stop.wait(2.0)
                continue
            if plan.version == 0:
                self._stop.wait(1.0 if not plan.sources else 0)  # polled: no plan
                continue
            try:
                self.pull(key, plan)
            except Exception as e:  # noqa: BLE001 - the follower must outlive a bad pull
                log.warning("pulling weights %s v%d: %s", key[1], plan.version, e)
                metrics.WEIGHTS_VERSIONS.labels("failed").inc()
                self._announce(cpb.AnnounceWeightsRequest(
                    node=self.node, job_id=job_id, channel=key[1], lineage=plan.lineage,
                    version=plan.version, failed=True))  # fmt: skip
                self._stop.wait(1.0)
                continue
            self._announce(cpb.AnnounceWeightsRequest(
                node=self.node, job_id=job_id, channel=key[1], lineage=plan.lineage,
                version=plan.version))  # fmt: skip

    def pull(self, key: tuple[str, str], plan: cpb.WeightsPlan) -> Version:
        """Get the plan's version whole (see the module's docstring).

        Raises: StorageUnavailable when no source delivered it."""
        sources = list(plan.sources)
        req = agent_pb2.WeightsRequest(tenant=key[0], channel=key[1], lineage=plan.lineage,
                                       version=plan.version, token=plan.token)  # fmt: skip
        ix, why = None, []
        for s in sources:
            try:
                with self._client(s) as stub:
                    ix = parse_index(stub.WeightsIndex(req, timeout=20).index)
                break
            except errors.SnapshotterError as e:
                why.append(f"{s.node}: {e.cause}")
        if ix is None:
            raise errors.StorageUnavailable(
                f"no source had version {plan.version} of {key[1]!r} ({'; '.join(why)})",
                "the node pulls the next version the trainer publishes")
        if (ix.channel, ix.lineage, ix.version) != (key[1], plan.lineage, plan.version):
            raise errors.InvalidArgument("a source sent the index of another version",
                                         "use the same snapshotter version on every node")
        prev = self.newest(key)
        todo_names = set(changed(ix, prev.index if prev else None))
        v = self._begin(key, ix, plan.token)
        try:
            if prev is not None:
                self._copy_unchanged(prev, v, todo_names)
            todo = [e for e in ix.entries if e.name in todo_names]
            for s in sources:
                if not todo:
                    break
                todo = self._receive(s, v, req, todo)
            if todo:
                raise errors.StorageUnavailable(
                    f"{len(todo)} tensor(s) of version {plan.version} of {key[1]!r} came from "
                    "no source", "the node pulls the next version the trainer publishes")
        except BaseException:
            self._drop(key, v)
            raise
        self._hold(key, v)
        self.pulled += 1
        metrics.WEIGHTS_VERSIONS.labels("pulled").inc()
        return v

    def _copy_unchanged(self, prev: Version, v: Version, todo: set[str]) -> None:
        old = prev.index.by_name()
        src = os.open(prev.data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open(v.data, "r+b", buffering=0) as out:
                for e in v.index.entries:
                    if e.name not in todo:
                        _copy(src, old[e.name].offset, out.fileno(), e.offset, e.length)
                        metrics.WEIGHTS_BYTES.labels("unchanged").inc(e.length)
                        v.mark(e.name)
        finally:
            os.close(src)

    def _receive(self, source: cpb.WeightsSource, v: Version, req: agent_pb2.WeightsRequest,
                 todo: list[Entry]) -> list[Entry]:  # fmt: skip
        """Read `todo` from `source` into v; return what did not arrive verified."""
        ask = agent_pb2.WeightsRequest()
        ask.CopyFrom(req)
        ask.names.extend(e.name for e in todo)
        left = list(todo)
        deadline = 60 + sum(e.length for e in todo) / (20 << 20)  # ≥ 20 MB/s, or it stalled
        try:
            with self._client(source) as stub, open(v.data, "r+b", buffering=0) as out:
                cur: Entry | None = None
                h = xxhash.xxh3_64()
                got = 0
                for piece in stub.ReadWeights(ask, timeout=deadline):
                    if piece.name:
                        if cur is not None or piece.name != left[0].name:
                            raise errors.InvalidArgument(
                                f"node {source.node} sent {piece.name!r} out of order",
                                "the node pulls from the next source")
                        cur, h, got = left[0], xxhash.xxh3_64(), 0
                    if cur is None or got + len(piece.data) > cur.length:
                        raise errors.InvalidArgument(f"node {source.node} sent stray bytes",
                                                     "the node pulls from the next source")
                    os.pwrite(out.fileno(), piece.data, cur.offset + got)
                    h.update(piece.data)
                    got += len(piece.data)
                    self.fetched_bytes += len(piece.data)
                    metrics.WEIGHTS_BYTES.labels("fetched").inc(len(piece.data))
                    if got == cur.length:
                        if h.hexdigest() != cur.digest:
                            raise errors.InvalidArgument(
                                f"tensor {cur.name!r} from node {source.node} does not match "
                                "its digest", "the node pulls it from the next source")
                        v.mark(cur.name)
                        left.pop(0)
                        cur = None
        except errors.SnapshotterError as e:
            log.warning("weights %s v%d from %s: %s (%d tensor(s) left)", req.channel,
                        req.version, source.node, e.cause, len(left))  # fmt: skip
        return left

    def _client(self, source: cpb.WeightsSource) -> Any:
        """A client of `source`'s agent, kept between pulls (a TLS handshake per pull costs
        more than a small version's bytes)."""
        with self._cond:
            client = self._clients.get((source.node, source.address))
            if client is None:
                for k in [k for k in self._clients if k[0] == source.node]:
                    self._clients.pop(k).close()  # it moved
                client = self._clients[(source.node, source.address)] = agent_client(
                    Target(source.address, tls=self.peer_tls, server_name=source.node),
                    peer="agent")  # fmt: skip
        return contextlib.nullcontext(client.stub)


def _copy(src: int, src_off: int, dst: int, dst_off: int, length: int) -> None:
    """Copy `length` bytes between two files in the kernel."""
    done = 0
    while done < length:
        n = os.copy_file_range(src, dst, length - done, src_off + done, dst_off + done)
        if n == 0:
            raise errors.StorageUnavailable(
                f"a held version ended {length - done} bytes early",
                "the node pulls the next version whole",
            )
        done += n


def _pieces(fd: int, offset: int, length: int, buf: memoryview) -> Iterator[memoryview]:
    """`length` bytes of `fd` from `offset`, read into `buf` piece by piece."""
    done = 0
    while done < length:
        n = os.preadv(fd, [buf[: min(len(buf), length - done)]], offset + done)
        if n == 0:
            raise errors.InvalidArgument(
                f"staged weights ended {length - done} bytes early",
                "the rank released its staging memory before the agent took them",
            )
        yield buf[:n]
        done += n


def _buffer(entries: tuple[Entry, ...]) -> memoryview:
    return memoryview(bytearray(min(PIECE, max((e.length for e in entries), default=0)) or 1))


def _digests(sources: list[tuple[int, int]], entries: tuple[Entry, ...]) -> list[str]:
    """The xxh3-64 (hex) of each entry's bytes at (fd, offset)."""
    buf = _buffer(entries)
    out = []
    for (fd, off), e in zip(sources, entries, strict=True):
        h = xxhash.xxh3_64()
        for piece in _pieces(fd, off, e.length, buf):
            h.update(piece)
        out.append(h.hexdigest())
    return out


def _copy_in(v: Version, sources: list[tuple[int, int]]) -> None:
    """Copy each tensor from (fd, offset) into the version's file, marking each ready."""
    buf = _buffer(v.index.entries)
    with open(v.data, "r+b", buffering=0) as f:
        for (fd, off), e in zip(sources, v.index.entries, strict=True):
            at = e.offset
            for piece in _pieces(fd, off, e.length, buf):
                os.pwrite(f.fileno(), piece, at)
                at += len(piece)
            v.mark(e.name)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _unlink(v: Version) -> None:
    v.data.unlink(missing_ok=True)
    v.data.with_suffix(".json").unlink(missing_ok=True)


__all__ = ["RpcRegistry", "WeightsHub", "common_pb2"]
