"""Service entry points: the coordinator, a node agent, or both (the embedded default).

`python -m snapshotter.daemon embedded --home H` is what the CLI starts in the background when
no coordinator is configured. It writes `H/daemon.json` (pid and addresses) once both services
answer, and removes it when it stops (SIGTERM, or the Shutdown call of `snapshotter down`).
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
from pathlib import Path
from typing import Any

from coordinator.epoch import take_token
from coordinator.service import COORDINATOR_SERVICE, Coordinator, coordinator_service
from snapshotter import errors
from snapshotter.agent.fencing import Fence
from snapshotter.agent.netenv import interface_of, node_network_env
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.agent.service import agent_service
from snapshotter.config import Paths, default_home, store_url
from snapshotter.rpc.wire import Client, Server
from snapshotter.storage.url import open_store

AGENT_SERVICE = "snapshotter.Agent"
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


def serve_embedded(paths: Paths, bind_host: str = "127.0.0.1") -> int:
    paths.home.mkdir(parents=True, exist_ok=True)
    url = store_url(paths)
    store = open_store(url)
    stop = threading.Event()

    settings = NodeSettings(
        name=socket.gethostname(),
        paths=paths,
        host=bind_host,
        private_tmp=os.environ.get("SNAPSHOTTER_PRIVATE_TMP", "1") != "0",
    )
    agent = NodeAgent(settings, store)
    agent_server = Server(f"{bind_host}:0")
    u, s = agent_service(agent)
    agent_server.add_service(AGENT_SERVICE, u, s)

    coord = Coordinator(store, url)
    coord_server = Server(f"{bind_host}:0")
    cu, cs = coordinator_service(coord)

    def shutdown(req: dict[str, Any]) -> dict[str, Any]:
        running = coord.running_jobs()
        if running and not req.get("force"):
            raise errors.InvalidArgument(
                f"jobs still running: {', '.join(running)}",
                "freeze or cancel them first, or `snapshotter down --force` to stop them",
            )
        stop.set()
        return {"stopping": True, "cancelled": running}

    coord_server.add_service(COORDINATOR_SERVICE, {**cu, "Shutdown": shutdown}, cs)
    agent_server.start()
    coord_server.start()
    coord.register_agent(agent.settings.name, agent_server.address, bind_host)
    probe = Client(coord_server.address, COORDINATOR_SERVICE)
    probe.call("Ping")
    probe.close()
    _write_atomic(
        paths.daemon_file,
        {
            "pid": os.getpid(),
            "coordinator": coord_server.address,
            "agent": agent_server.address,
            "store": url,
        },
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info(
        "embedded coordinator %s, agent %s, store %s",
        coord_server.address,
        agent_server.address,
        url,
    )
    try:
        stop.wait()
    finally:
        try:
            if (
                paths.daemon_file.exists()
                and json.loads(paths.daemon_file.read_text())["pid"] == os.getpid()
            ):
                paths.daemon_file.unlink()
        except (OSError, ValueError, KeyError):
            pass
        agent.shutdown()
        coord_server.stop(2)
        agent_server.stop(2)
    return 0


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def serve_coordinator(listen: str, url: str, agent_ttl: float = 15.0) -> int:
    """A standalone coordinator (`snapshotter coordinator`): agents register with it."""
    store = open_store(url)
    token = take_token(store)  # fails with StorageUnavailable when the store is unreachable
    coord = Coordinator(store, url, token, agent_ttl=agent_ttl)
    server = Server(listen)
    server.add_service(COORDINATOR_SERVICE, *coordinator_service(coord))
    server.start()
    log.info("coordinator %s, epoch %s, store %s", server.address, token, url)
    print(json.dumps({"coordinator": server.address, "fence": list(token)}), flush=True)
    try:
        _wait_for_signal()
    finally:
        server.stop(2)
    return 0


def serve_agent(
    paths: Paths,
    listen: str,
    coordinator: str,
    name: str,
    url: str,
    env_overrides: dict[str, str],
    heartbeat_s: float = 2.0,
    freeze_lease_s: float = 60.0,
) -> int:
    """A standalone node agent (`snapshotter agent`), registered with `coordinator` and kept
    registered by a heartbeat (a restarted coordinator re-learns this node and its jobs)."""
    paths.home.mkdir(parents=True, exist_ok=True)
    host = listen.rsplit(":", 1)[0]
    settings = NodeSettings(
        name=name,
        paths=paths,
        host=host,
        network_env=tuple(sorted(node_network_env(interface_of(host), env_overrides).items())),
        private_tmp=os.environ.get("SNAPSHOTTER_PRIVATE_TMP", "1") != "0",
        freeze_lease_s=freeze_lease_s,
    )
    agent = NodeAgent(settings, open_store(url))
    fence = Fence(on_newer=agent.expire_freezes)
    server = Server(listen)
    server.add_service(AGENT_SERVICE, *agent_service(agent, fence))
    server.start()
    coord = Client(coordinator, COORDINATOR_SERVICE)
    stop = threading.Event()
    incarnation = agent.incarnation

    def heartbeat() -> None:
        down_since: float | None = None
        while not stop.is_set():
            try:
                reply = coord.call(
                    "RegisterAgent",
                    {"name": name, "address": server.address, "host": host, "heartbeat": True,
                     "incarnation": incarnation},  # fmt: skip
                    timeout=10,
                )
                if down_since is not None:
                    log.info("coordinator %s is back", coordinator)
                down_since = None
                if reply.get("fence"):
                    try:
                        fence.check(reply["fence"])  # learn a newer coordinator's token early
                    except errors.Fenced:
                        pass  # an older coordinator answered: its calls stay refused
            except errors.SnapshotterError as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("coordinator %s unreachable (%s); retrying", coordinator, e)
            stop.wait(heartbeat_s)

    threading.Thread(target=heartbeat, daemon=True, name="heartbeat").start()
    log.info("agent %s on %s (ranks' network env %s)", name, server.address, settings.network_env)
    print(json.dumps({"agent": name, "address": server.address}), flush=True)
    try:
        _wait_for_signal()
    finally:
        stop.set()
        agent.shutdown()
        server.stop(2)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snapshotter-daemon")
    ap.add_argument("mode", choices=["embedded", "coordinator", "agent"])
    ap.add_argument("--home", default=None)
    ap.add_argument("--bind-host", default="127.0.0.1")
    ap.add_argument("--listen", default=None, help="host:port to serve on")
    ap.add_argument("--store", default=None, help="snapshot store URL")
    ap.add_argument("--coordinator", default=None, help="host:port of the coordinator")
    ap.add_argument("--name", default=None, help="this node's name")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for this node's ranks")
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--freeze-lease", type=float, default=60.0)
    ap.add_argument("--agent-ttl", type=float, default=15.0)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    paths = Paths(Path(a.home).resolve() if a.home else default_home())
    bound_malloc()
    try:
        if a.mode == "embedded":
            return serve_embedded(paths, a.bind_host)
        url = a.store or store_url(paths)
        if a.mode == "coordinator":
            return serve_coordinator(a.listen or "0.0.0.0:7070", url, a.agent_ttl)
        if not a.coordinator:
            raise errors.InvalidArgument("an agent needs --coordinator HOST:PORT",
                                         "pass the coordinator's address")
        overrides = dict(kv.split("=", 1) for kv in a.env)
        return serve_agent(
            paths, a.listen or f"{a.bind_host}:0", a.coordinator,
            a.name or socket.gethostname(), url, overrides, a.heartbeat, a.freeze_lease,
        )  # fmt: skip
    except errors.SnapshotterError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
