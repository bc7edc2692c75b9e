"""Serving the provider API: uvicorn on a socket we bind, HTTPS beyond loopback.

Like the gRPC services (rpc/server.py check_listen): plain HTTP only on a loopback address;
anywhere else the gateway needs a certificate and key (HTTPS). Callers always authenticate with
a bearer token, which the coordinator checks.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from snapshotter import errors
from snapshotter.gateway.app import create_app
from snapshotter.rpc.server import is_loopback
from snapshotter.rpc.tls import TlsFiles


@dataclass(frozen=True)
class GatewayConfig:
    listen: str  # HOST:PORT
    coordinator: str  # HOST:PORT of the coordinator's gRPC service
    coordinator_tls: TlsFiles | None = None  # a `client` certificate toward it
    https_cert: Path | None = None
    https_key: Path | None = None


def check(cfg: GatewayConfig) -> None:
    """Raises InvalidArgument for a listen address the policy forbids."""
    host = cfg.listen.rsplit(":", 1)[0].strip("[]")
    if (cfg.https_cert is None) != (cfg.https_key is None):
        raise errors.InvalidArgument("--https-cert and --https-key go together", "give both")
    if cfg.https_cert is None and not is_loopback(host):
        raise errors.InvalidArgument(
            f"refusing to serve the provider API on {cfg.listen} without HTTPS: bearer tokens "
            "would cross the network in the clear",
            "give it --https-cert and --https-key, or listen on a loopback address",
        )


def bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, int(port)))
    except (OSError, ValueError) as e:
        sock.close()
        raise errors.ServiceUnavailable(f"cannot bind the provider API to {listen}: {e}",
                                        "choose a free address/port") from e  # fmt: skip
    sock.listen(128)
    return sock


class Gateway:
    """A running gateway; `address` is where it listens (its real port)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        check(cfg)
        self.sock = bind(cfg.listen)
        host, port = self.sock.getsockname()[:2]
        self.address = f"{host}:{port}"
        app = create_app(cfg.coordinator, cfg.coordinator_tls)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off",
            ssl_certfile=str(cfg.https_cert) if cfg.https_cert else None,
            ssl_keyfile=str(cfg.https_key) if cfg.https_key else None,
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def start(self) -> Gateway:
        self._thread = threading.Thread(target=self.run, name="gateway", daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        self.server.run(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
