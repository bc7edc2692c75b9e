"""Service entry points: the coordinator, a node agent, or both (the embedded default).

`python -m snapshotter.daemon embedded --home H` is what the CLI starts in the background when
no coordinator is configured: both services in one process, each on a unix socket under
H/run/ that only root can open. It writes H/daemon.json (pid and addresses) once both answer,
and removes it when it stops (SIGTERM, or the Shutdown call of `snapshotter down`).

`snapshotter coordinator` and `snapshotter agent` (cli/services.py) call serve_coordinator and
serve_agent: standalone services on TCP, under the listen policy of rpc/server.py.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from snapshotter import __version__, errors, metrics, sdnotify, servicelog
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.fencing import Fence
from snapshotter.agent.links import LinkWatcher, check_links
from snapshotter.agent.netenv import interface_of, node_network_env
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.agent.retention import Retention
from snapshotter.agent.weights import RpcRegistry
from snapshotter.config import (
    Paths,
    chunk_cache_bytes,
    default_home,
    encrypt_at_rest,
    keep_jobs,
    store_url,
)
from snapshotter.coordinator import service as coordinator_service
from snapshotter.coordinator.core import Coordinator
from snapshotter.coordinator.drain import drain_node
from snapshotter.coordinator.epoch import take_token
from snapshotter.coordinator.quotas import TenantLimits
from snapshotter.coordinator.supervisor import Supervisor
from snapshotter.coordinator.webhooks import WebhookConfig, Webhooks
from snapshotter.keeper import ENV as KEEPER_ENV
from snapshotter.rpc import relay
from snapshotter.rpc.audit import AuditLog
from snapshotter.rpc.client import Target, coordinator_client
from snapshotter.rpc.server import Listen, serve
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.cache import CachedStore
from snapshotter.storage.local import LocalDirStore
from snapshotter.storage.url import open_store
from snapshotter.v1 import coordinator_pb2

log = logging.getLogger("snapshotter.daemon")

# glibc's mallopt parameters (malloc.h).
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def bound_malloc() -> None:
    """Keep the service's memory from ratcheting up with every freeze and thaw.

    The data path allocates one 8 MiB buffer per chunk in flight, on worker threads. glibc
    serves the first from mmap and returns it on free, but then raises its mmap threshold to
    that size (the "dynamic threshold"), so every later buffer comes from a per-thread arena
    that keeps the memory: measured here, the embedded daemon's RSS climbed from 59 to 199 MB
    over 25 jobs. A fixed threshold (which also turns the dynamic one off) sends every buffer
    of 1 MiB or more to mmap and back to the kernel when freed; fewer arenas bound the rest.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
        libc.mallopt(_M_ARENA_MAX, 4)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator has its own policy


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class _Stop(threading.Event):
    """Set by SIGTERM, SIGINT or (under a keeper) SIGHUP; `signum` says which."""

    signum: int | None = None

    @property
    def reload(self) -> bool:
        """Stopping to be started again by the keeper: the ranks go on without us."""
        return self.signum == signal.SIGHUP


def _stop_event() -> _Stop:
    stop = _Stop()

    def handler(signum: int, frame: Any) -> None:
        stop.signum = signum
        stop.set()

    sigs = [signal.SIGTERM, signal.SIGINT]
    if os.environ.get(KEEPER_ENV):
        sigs.append(signal.SIGHUP)  # the keeper's reload (snapshotter/keeper.py)
    for sig in sigs:
        signal.signal(sig, handler)
    return stop


def drain_grace() -> float:
    """Seconds a stopping agent gives its jobs to freeze (SNAPSHOTTER_DRAIN_GRACE_S, 30):
    keep the service manager's stop timeout above it."""
    try:
        v = float(os.environ.get("SNAPSHOTTER_DRAIN_GRACE_S", "30"))
    except ValueError:
        v = 30.0
    return v if v > 0 else 30.0


def _drained(reply: coordinator_pb2.DrainReply) -> None:
    for j in reply.jobs:
        how = "fell back to" if j.fallback else "frozen as"
        log.warning("preempted: job %s %s %s%s", j.job_id, how, j.snapshot_id or "(none)",
                    f"; thawed on {','.join(j.thawed_on)}" if j.thawed_on else "")  # fmt: skip


def node_store(store: ObjectStore, paths: Paths) -> ObjectStore:
    """The store as a node agent uses it: behind the node's chunk cache, unless the store is
    a local directory already (or SNAPSHOTTER_CHUNK_CACHE_BYTES=0)."""
    limit = chunk_cache_bytes()
    if limit <= 0 or isinstance(store, LocalDirStore):
        return store
    return CachedStore(store, paths.home / "chunk-cache", limit)


def serve_embedded(paths: Paths, bind_host: str = "127.0.0.1") -> int:
    paths.home.mkdir(parents=True, exist_ok=True)
    url = store_url(paths)
    store = open_store(url)
    stop = _stop_event()
    settings = NodeSettings(
        name=socket.gethostname(),
        paths=paths,
        host=bind_host,
        private_tmp=os.environ.get("SNAPSHOTTER_PRIVATE_TMP", "1") != "0",
        # Only root reaches the embedded agent (its socket): it may run what root may.
        policy=ExecPolicy(anything=True),
        retention=Retention(finished_jobs=keep_jobs()),
        store_url=url,
    )
    agent = NodeAgent(settings, node_store(store, paths))
    agent_server = serve(
        "agent",
        Listen(f"unix:{paths.run_dir / 'agent.sock'}"),
        agent_service.register(agent),
        [agent_service.SERVICE],
    )
    coord = Coordinator(
        store, url, lambda address, name: Target(address, server_name=name),
        keep_finished_jobs=keep_jobs(), keys_dir=paths.keys_dir, encrypt=encrypt_at_rest(),
        limits=TenantLimits(paths.tenants_file),
        webhooks=Webhooks(WebhookConfig(paths.webhooks_file)),
    )  # fmt: skip
    agent.weights.attach(coord.weights)
    supervisor = Supervisor(coord, tick_s=supervise_tick())
    supervisor.start()

    def shutdown(force: bool) -> coordinator_pb2.ShutdownReply:
        running = coord.running_jobs()
        if running and not force:
            raise errors.InvalidArgument(
                f"jobs still running: {', '.join(running)}",
                "freeze or cancel them first, or `snapshotter down --force` to stop them",
            )
        stop.set()
        return coordinator_pb2.ShutdownReply(stopping=True, cancelled=running)

    coord_server = serve(
        "coordinator",
        Listen(f"unix:{paths.run_dir / 'coordinator.sock'}"),
        coordinator_service.register(coord, shutdown),
        [coordinator_service.SERVICE],
        audit=AuditLog(paths.audit_log),
    )
    coord.register_agent(
        coordinator_pb2.RegisterAgentRequest(
            name=settings.name, address=agent_server.address, host=bind_host,
            incarnation=agent.incarnation, version=__version__,
        )
    )  # fmt: skip
    _write_atomic(
        paths.daemon_file,
        {"pid": os.getpid(), "coordinator": coord_server.address, "agent": agent_server.address,
         "store": url, "version": __version__,
         "keeper": os.getppid() if os.environ.get(KEEPER_ENV) else None},
    )  # fmt: skip
    log.info("embedded coordinator %s, agent %s, store %s", coord_server.address,
             agent_server.address, url)  # fmt: skip
    try:
        stop.wait()
        if stop.signum == signal.SIGTERM and coord.running_jobs():
            # Told to stop (a preemption, the node going away): freeze its jobs first.
            try:
                _drained(drain_node(coord, coordinator_pb2.DrainRequest(
                    node=settings.name, grace_s=drain_grace())))  # fmt: skip
            except errors.SnapshotterError as e:
                log.error("could not drain before stopping: %s", e)
    finally:
        try:
            if json.loads(paths.daemon_file.read_text())["pid"] == os.getpid():
                paths.daemon_file.unlink()
        except (OSError, ValueError, KeyError):
            pass
        supervisor.stop()
        agent.shutdown(keep_ranks=stop.reload)
        coord_server.stop(2)
        agent_server.stop(2)
    return 0


@dataclass(frozen=True)
class CoordinatorConfig:
    listen: Listen
    store_url: str
    # How it calls agents: its TLS files (its certificate says role coordinator), or a token
    # an agent's --tokens file accepts (agents on plaintext loopback).
    agent_tls: Any = None
    agent_token: str | None = None
    agent_ttl: float = 15.0
    # Heartbeats a second it takes before asking agents to beat less often (0: no bound).
    max_heartbeats_per_s: float = 512.0
    keys_dir: Path | None = None  # its signing and data keys (None: in memory only)
    encrypt: bool = True  # seal snapshots' chunks under their tenants' data keys
    audit_log: Path | None = None  # where every action is recorded (rpc/audit.py)
    tenants_file: Path | None = None  # per-tenant limits (coordinator/quotas.py)
    webhooks_file: Path | None = None  # tenants' webhooks (coordinator/webhooks.py)
    metrics_listen: str | None = None  # HOST:PORT of its Prometheus endpoint (metrics.py)


def serve_coordinator(cfg: CoordinatorConfig) -> int:
    """A standalone coordinator (`snapshotter coordinator`): agents register with it."""
    store = open_store(cfg.store_url)
    token = take_token(store)  # fails with StorageUnavailable when the store is unreachable

    def agent_target(address: str, name: str) -> Target:
        return Target(address, tls=cfg.agent_tls, server_name=name, token=cfg.agent_token,
                      fence=token)  # fmt: skip

    coord = Coordinator(store, cfg.store_url, agent_target, token, agent_ttl=cfg.agent_ttl,
                        keep_finished_jobs=keep_jobs(), keys_dir=cfg.keys_dir,
                        encrypt=cfg.encrypt, limits=TenantLimits(cfg.tenants_file),
                        webhooks=Webhooks(WebhookConfig(cfg.webhooks_file)),
                        max_beats_per_s=cfg.max_heartbeats_per_s)  # fmt: skip
    metrics.watch_coordinator(coord.agent_census, coord.job_census)
    exporter = _metrics(cfg.metrics_listen, metrics.COORDINATOR, cfg.listen, "coordinator")
    supervisor = Supervisor(coord, tick_s=supervise_tick())
    supervisor.start()
    stop = _stop_event()
    server = serve(
        "coordinator",
        cfg.listen,
        coordinator_service.register(coord),
        [coordinator_service.SERVICE],
        audit=None if cfg.audit_log is None else AuditLog(cfg.audit_log),
    )
    log.info("coordinator %s, epoch %s, store %s", server.address, token, cfg.store_url)
    print(json.dumps({"coordinator": server.address, "fence": list(token),
                      "metrics": exporter.address if exporter else None}), flush=True)  # fmt: skip
    sdnotify.notify("READY=1", f"STATUS=serving {server.address}")
    try:
        stop.wait()
    finally:
        sdnotify.notify("STOPPING=1")
        supervisor.stop()
        server.stop(2)
        if exporter is not None:
            exporter.stop()
    return 0


def _metrics(listen: str | None, registry: metrics.CollectorRegistry, service: Listen,
             kind: str) -> metrics.MetricsServer | None:  # fmt: skip
    """The service's Prometheus endpoint, if asked for (over TLS with its own certificate
    beyond loopback)."""
    return None if listen is None else metrics.serve(listen, registry, service.tls, kind)


def supervise_tick() -> float:
    """How often the supervisor looks at every job (SNAPSHOTTER_SUPERVISE_S, default 1 s):
    the bound on how late a failure is noticed or a snapshot starts."""
    try:
        v = float(os.environ.get("SNAPSHOTTER_SUPERVISE_S", "1.0"))
    except ValueError:
        v = 1.0
    return v if v > 0 else 1.0


@dataclass(frozen=True)
class AgentConfig:
    paths: Paths
    listen: Listen
    coordinator: Target
    name: str
    store_url: str
    env_overrides: dict[str, str] = field(default_factory=dict)
    links: tuple[str, ...] = ()
    heartbeat_s: float = 2.0
    freeze_lease_s: float = 60.0
    policy: ExecPolicy = field(default_factory=ExecPolicy.default)
    metrics_listen: str | None = None  # HOST:PORT of its Prometheus endpoint (metrics.py)


def serve_agent(cfg: AgentConfig) -> int:
    """A standalone node agent (`snapshotter agent`), registered with its coordinator and kept
    registered by a heartbeat (a restarted coordinator re-learns this node and its jobs)."""
    cfg.paths.home.mkdir(parents=True, exist_ok=True)
    check_links(cfg.links, cfg.env_overrides)
    host = cfg.listen.host
    settings = NodeSettings(
        name=cfg.name,
        paths=cfg.paths,
        host=host,
        network_env=tuple(sorted(node_network_env(interface_of(host), cfg.env_overrides).items())),
        private_tmp=os.environ.get("SNAPSHOTTER_PRIVATE_TMP", "1") != "0",
        freeze_lease_s=cfg.freeze_lease_s,
        policy=cfg.policy,
        retention=Retention(finished_jobs=keep_jobs()),
        peer_tls=cfg.listen.tls,
        links=cfg.links,
        store_url=cfg.store_url,
    )
    agent = NodeAgent(settings, node_store(open_store(cfg.store_url), cfg.paths))
    metrics.watch_ranks(agent.sample_running)
    exporter = _metrics(cfg.metrics_listen, metrics.AGENT, cfg.listen, "agent")
    fence = Fence(on_newer=agent.freezes.expire_all)
    # Whose calls relayed by other nodes this node runs: its coordinator's key, learnt below.
    trust = relay.Trust(cfg.name)
    stop = _stop_event()
    server = serve(
        "agent",
        cfg.listen,
        agent_service.register(agent),
        [agent_service.SERVICE],
        extra_check=agent_service.fence_check(fence),
        trust=trust,
    )
    coord = coordinator_client(cfg.coordinator, peer="agent")
    agent.weights.attach(RpcRegistry(coord.stub))
    beat_now = threading.Event()
    # Heartbeats go on after a SIGTERM, until the drain is over: a node draining itself must
    # not look lost to the coordinator meanwhile (its jobs would be frozen, not migrated).
    beats_done = threading.Event()
    watcher = LinkWatcher(agent.links, lambda _: beat_now.set())

    def heartbeat() -> None:
        down_since: float | None = None
        asked = 0.0  # the coordinator's last word on how often to beat (a large cluster)
        while not beats_done.is_set():
            beat_now.clear()
            req = coordinator_pb2.RegisterAgentRequest(
                name=cfg.name, address=server.address, host=host, heartbeat=True,
                incarnation=agent.incarnation, version=__version__,
                links=[lk.to_proto() for lk in watcher.last],
            )  # fmt: skip
            try:
                reply = coord.stub.RegisterAgent(req, timeout=10)
                metrics.HEARTBEATS_SENT.labels("ok").inc()
                asked = reply.beat_s
                if down_since is not None:
                    log.info("coordinator %s is back", cfg.coordinator.address)
                down_since = None
                current = True
                if reply.HasField("fence"):
                    try:  # learn a newer coordinator's token early
                        fence.check([reply.fence.epoch, reply.fence.id])
                    except errors.Fenced:
                        current = False  # an older coordinator answered: its calls stay refused
                if current and reply.relay_key:
                    try:
                        trust.learn(reply.relay_key)
                    except ValueError as e:  # not an Ed25519 key: relayed calls stay refused
                        log.warning("coordinator %s sent a bad relay key: %s",
                                    cfg.coordinator.address, e)  # fmt: skip
            except errors.SnapshotterError as e:
                metrics.HEARTBEATS_SENT.labels(e.code).inc()
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("coordinator %s: %s; retrying", cfg.coordinator.address, e)
            beat_now.wait(max(cfg.heartbeat_s, asked))  # a link change beats at once

    threading.Thread(target=heartbeat, daemon=True, name="heartbeat").start()
    watcher.start()
    log.info("agent %s on %s (ranks' network env %s)", cfg.name, server.address,
             settings.network_env)  # fmt: skip
    print(json.dumps({"agent": cfg.name, "address": server.address,
                      "metrics": exporter.address if exporter else None}), flush=True)  # fmt: skip
    sdnotify.notify("READY=1", f"STATUS=serving {server.address}")
    try:
        stop.wait()
        # A reload (SIGHUP) restarts only the agent: its keeper stays, and the new agent
        # says READY=1 again.
        doing = ("draining" if stop.signum == signal.SIGTERM else
                 "restarting the agent" if stop.reload else "stopping")  # fmt: skip
        sdnotify.notify("RELOADING=1" if stop.reload else "STOPPING=1", f"STATUS={doing}")
        if stop.signum == signal.SIGTERM and agent.jobs.running_ids():
            # Told to stop (a preemption, the node going away): the coordinator freezes this
            # node's jobs first (and, with --recover auto, thaws them elsewhere).
            try:
                grace = drain_grace()
                _drained(coord.stub.DrainSelf(
                    coordinator_pb2.DrainRequest(node=cfg.name, grace_s=grace),
                    timeout=grace + 300))  # fmt: skip
            except errors.SnapshotterError as e:
                log.error("could not drain before stopping: %s", e)
    finally:
        beats_done.set()
        beat_now.set()
        agent.shutdown(keep_ranks=stop.reload)
        server.stop(2)
        coord.close()
        if exporter is not None:
            exporter.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snapshotter-daemon")
    ap.add_argument("mode", choices=["embedded"])
    ap.add_argument("--home", default=None)
    ap.add_argument("--bind-host", default="127.0.0.1")
    a = ap.parse_args(argv)
    servicelog.setup()
    bound_malloc()
    paths = Paths(Path(a.home).resolve() if a.home else default_home())
    try:
        return serve_embedded(paths, a.bind_host)
    except errors.SnapshotterError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
