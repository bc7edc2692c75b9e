"""Routing around a dead data link for real: two nodes with two data links each (network
namespaces on two bridges), a TCP stream between their plane-0 addresses, the plane-0 link
cut mid-stream. With the agents' bridge routes (agent/links.py) the stream's bytes arrive,
in order and whole, over plane 1; the routes are ours alone and go away again."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.netns import (
    Cluster,
    Node,
    netns_cluster,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.timeout(120)

PY = sys.executable
REPO = str(Path(__file__).resolve().parents[2])
TOTAL = 40 * 1000  # bytes: 40 messages, one every 0.1 s

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5071)); s.listen(); print("ready", flush=True)
c, _ = s.accept(); got = b""
while True:
    d = c.recv(65536)
    if not d: break
    got += d
print(len(got), got == b"".join(bytes([i]) * 1000 for i in range(40)), flush=True)
"""
CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5071), source_address=(sys.argv[2], 0))
for i in range(40):
    s.sendall(bytes([i]) * 1000); time.sleep(0.1)
s.close()
"""


def _bridge(node: Node, plane: int, routes: list[tuple[str, str]], remove: bool) -> None:
    code = (f"import sys; sys.path.insert(0, {REPO!r}); from snapshotter.agent.links import "
            f"Links; Links({node.links!r}, {{}}).bridge({plane}, {routes!r}, {remove})")
    node.run([PY, "-c", code], check=True, capture_output=True)


def _ours(node: Node) -> str:
    return node.run(["ip", "route", "show", "proto", "252"], capture_output=True,
                    text=True, check=True).stdout  # fmt: skip


@pytest.mark.parametrize("side", ["host", "node"])
def test_a_stream_survives_its_link_dying_through_bridge_routes(
    netns_cluster: Callable[..., Cluster],  # noqa: F811 - the fixture
    side: str,
) -> None:
    cluster = netns_cluster(["a", "b"], data_links=2)
    a, b = cluster["a"], cluster["b"]
    server = b.popen([PY, "-c", SERVER, b.link_ips[0]], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    client = a.popen([PY, "-c", CLIENT, b.link_ips[0], a.link_ips[0]])
    time.sleep(1.0)
    b.set_link(0, False, side=side)  # the stream is mid-way: bytes are in flight
    time.sleep(0.5)
    _bridge(a, 1, [(b.link_ips[0], b.link_ips[1])], remove=False)
    _bridge(b, 1, [(a.link_ips[0], a.link_ips[1])], remove=False)
    assert f"{b.link_ips[0]} via {b.link_ips[1]} dev {a.links[1]}" in _ours(a)
    assert client.wait(timeout=60) == 0
    out, _ = server.communicate(timeout=60)
    assert out.split() == [str(TOTAL), "True"], out
    _bridge(a, 1, [(b.link_ips[0], b.link_ips[1])], remove=True)
    _bridge(b, 1, [(a.link_ips[0], a.link_ips[1])], remove=True)
    assert _ours(a) == "" and _ours(b) == ""
    # The kernel's own routes are untouched.
    main = a.run(["ip", "route", "show"], capture_output=True, text=True, check=True).stdout
    assert str(cluster.data_subnets[1]) in main
