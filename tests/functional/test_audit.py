"""Cluster audit pieces for real: the link probe over real sockets (plain on loopback, and
mutual TLS with the certificates `snapshotter certs init` makes), and the whole audit driven
by a coordinator over two node agents serving gRPC (CRIU, kernel, disk and store checks run
for real; the network-namespace test with a degraded link is in tests/e2e)."""

from __future__ import annotations

import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.agent import probe
from snapshotter.coordinator import audit
from snapshotter.rpc.tls import TlsFiles
from snapshotter.v1 import coordinator_pb2 as pb
from tests.support.agents import ROOT, Cluster

pytestmark = pytest.mark.timeout(300)
TOKEN = "ab" * 16


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls") / "tls"
    subprocess.run([sys.executable, "-m", "snapshotter", "certs", "init", str(d), "--nodes",
                    "a,b,c"], check=True, capture_output=True, cwd=ROOT, timeout=60)  # fmt: skip
    return d


def test_a_plain_probe_on_loopback_measures_the_link() -> None:
    port = probe.open_listener("127.0.0.1", TOKEN, "a", None)
    m = probe.probe("127.0.0.1", port, TOKEN, "b", 4 << 20, "127.0.0.1", None)
    # Loopback carries 64 KiB segments, so 4 MiB is ~64 of them and one tail-loss probe on a
    # loaded machine is already >1%: the ratio is checked to be a ratio, not to be near 0 (the
    # e2e audit test shapes a lossy veth link and checks that it is named).
    assert m.rtt_ms > 0 and m.mbps > 0 and 0 <= m.retrans <= 1


def test_no_listener_beyond_loopback_without_tls() -> None:
    with pytest.raises(errors.PermissionDenied, match="needs TLS"):
        probe.open_listener("10.255.255.1", TOKEN, "a", None)


def test_a_tls_probe_takes_only_the_named_node_and_the_token(certs: Path) -> None:
    a, b, c = (TlsFiles.in_dir(certs, f"nodes/{n}") for n in "abc")
    port = probe.open_listener("127.0.0.1", TOKEN, "a", b)
    m = probe.probe("127.0.0.1", port, TOKEN, "b", 1 << 20, "127.0.0.1", a)
    assert m.mbps > 0
    # Node c's certificate where the coordinator named a: the listener hangs up.
    port = probe.open_listener("127.0.0.1", TOKEN, "a", b)
    with pytest.raises((OSError, ConnectionError)):
        probe.probe("127.0.0.1", port, TOKEN, "b", 1 << 20, "127.0.0.1", c)
    # The right node with the wrong token: the same.
    port = probe.open_listener("127.0.0.1", TOKEN, "a", b)
    with pytest.raises((OSError, ConnectionError)):
        probe.probe("127.0.0.1", port, "cd" * 16, "b", 1 << 20, "127.0.0.1", a)
    # A listener that is not the node the prober expects fails the prober's check.
    port = probe.open_listener("127.0.0.1", TOKEN, "a", c)
    with pytest.raises(ssl.SSLCertVerificationError):
        probe.probe("127.0.0.1", port, TOKEN, "b", 1 << 20, "127.0.0.1", a)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ("n0", "n1", "n2"), ROOT / "examples" / "rl_weights.py", tcp=True)
    try:
        yield c
    finally:
        c.close()


def test_the_coordinator_audits_three_nodes(cluster: Cluster) -> None:
    report = audit.run(cluster.coord, pb.AuditRequest(link_bytes=2 << 20, storage_bytes=1 << 20))
    assert report.rounds == 3 and len(report.links) == 3
    for n in report.nodes:
        checks = {c.name: c for c in n.checks}
        assert checks["criu"].status == "ok", checks["criu"]
        assert checks["kernel"].status == "ok", checks["kernel"]
        assert checks["disk"].status == "ok" and checks["disk"].value > 0
        assert checks["storage_write"].value > 0 and checks["storage_read"].value > 0
        assert checks["gpus"].status == "skipped"
    assert all(x.mbps > 0 and not x.why or x.status != "failed" for x in report.links)
    assert {(i.node, i.plane) for i in report.interfaces} == {("n0", 0), ("n1", 0), ("n2", 0)}
    # Nothing left in the store by the storage probes.
    assert not list((cluster.tmp / "store").rglob("audit*"))
    with pytest.raises(errors.InvalidArgument, match="no live agent named zz"):
        audit.run(cluster.coord, pb.AuditRequest(nodes=["n0", "zz"]))
