"""Service entry points: the coordinator, a node agent, or both (the embedded default).

`python -m snapshotter.daemon embedded --home H` is what the CLI starts in the background when
no coordinator is configured. It writes `H/daemon.json` (pid and addresses) once both services
answer, and removes it when it stops (SIGTERM, or the Shutdown call of `snapshotter down`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from coordinator.service import COORDINATOR_SERVICE, Coordinator, coordinator_service
from snapshotter import errors
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.agent.service import agent_service
from snapshotter.config import Paths, default_home, store_url
from snapshotter.rpc.wire import Client, Server
from snapshotter.storage.url import open_store

AGENT_SERVICE = "snapshotter.Agent"
log = logging.getLogger("snapshotter.daemon")


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
    Client(coord_server.address, COORDINATOR_SERVICE).call("Ping")
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="snapshotter-daemon")
    ap.add_argument("mode", choices=["embedded"])
    ap.add_argument("--home", default=None)
    ap.add_argument("--bind-host", default="127.0.0.1")
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    paths = Paths(Path(a.home).resolve() if a.home else default_home())
    return serve_embedded(paths, a.bind_host)


if __name__ == "__main__":
    sys.exit(main())
