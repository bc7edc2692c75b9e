"""The control plane's contract and its security, with real gRPC servers and clients.

A small servicer stands in for the coordinator where only the transport is under test; the
agent tests use a real NodeAgent (nothing is launched unless allowed). Each bad input is
refused with a typed error, starts nothing, and the server keeps serving.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from snapshotter import __version__, errors
from snapshotter.agent import service as agent_service
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.node import NodeAgent, NodeSettings
from snapshotter.config import Paths
from snapshotter.rpc.auth import Role, TokenStore
from snapshotter.rpc.client import Target, agent_client, coordinator_client
from snapshotter.rpc.server import Listen, Served, serve
from snapshotter.rpc.tls import TlsFiles, init_ca
from snapshotter.storage.local import LocalDirStore
from snapshotter.v1 import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(60)
pb = coordinator_pb2
SERVICE = "snapshotter.v1.Coordinator"


class Fake(coordinator_pb2_grpc.CoordinatorServicer):
    """Answers like a coordinator would, and counts what it was asked to do."""

    def __init__(self) -> None:
        self.runs = 0

    def Ping(self, req: Any, ctx: Any) -> Any:
        return pb.CoordinatorInfo(version=__version__, pid=1)

    def Status(self, req: Any, ctx: Any) -> Any:
        raise errors.CriuFailed("restore", "/var/log/criu.log", ["Error (files-reg.c): bad size"])

    def Jobs(self, req: Any, ctx: Any) -> Any:
        raise ValueError("a bug")

    def Run(self, req: Any, ctx: Any) -> Any:
        self.runs += 1
        return pb.JobStatus(job_id=req.job_id, state="RUNNING")

    def Freeze(self, req: Any, ctx: Any) -> Iterator[Any]:
        for p in ("prepare", "quiesce"):
            yield pb.FreezeEvent(phase=common_pb2.PhaseEvent(phase=p))
        raise errors.QuiesceTimeout("rank 1 did not park", "retry")


def _serve(listen: Listen, fake: Fake | None = None) -> Served:
    fake = fake or Fake()
    def register(server: grpc.Server) -> None:
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(fake, server)

    return serve("coordinator", listen, register, [SERVICE])


@pytest.fixture()
def unix_server(tmp_path: Path) -> Iterator[tuple[Served, Fake]]:
    fake = Fake()
    srv = _serve(Listen(f"unix:{tmp_path / 'run' / 'c.sock'}"), fake)
    yield srv, fake
    srv.stop(0)


def test_errors_keep_their_class_and_fields_across_the_wire(unix_server: Any) -> None:
    srv, _ = unix_server
    c = coordinator_client(Target(srv.address))
    with pytest.raises(errors.CriuFailed) as ei:
        c.stub.Status(common_pb2.JobRef(job_id="j"), timeout=10)
    assert ei.value.log_path == "/var/log/criu.log"
    assert ei.value.tail == ["Error (files-reg.c): bad size"] and ei.value.action == "restore"
    with pytest.raises(errors.Internal, match="ValueError: a bug"):
        c.stub.Jobs(common_pb2.Empty(), timeout=10)
    # A stream delivers what came before its failure, then the typed error.
    got = []
    with pytest.raises(errors.QuiesceTimeout, match="rank 1"):
        for ev in c.stub.Freeze(pb.FreezeRequest(job_id="j"), timeout=10):
            got.append(ev.phase.phase)
    assert got == ["prepare", "quiesce"]
    assert c.stub.Ping(common_pb2.Empty(), timeout=10).pid == 1  # still serving


def test_a_malformed_message_is_an_invalid_argument(unix_server: Any) -> None:
    srv, fake = unix_server
    ch = grpc.insecure_channel(srv.address)
    with pytest.raises(grpc.RpcError) as ei:
        ch.unary_unary(f"/{SERVICE}/Run")(b"\x0a\xff\xff\xff\xff", timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in ei.value.details()
    assert fake.runs == 0
    assert coordinator_client(Target(srv.address)).stub.Ping(common_pb2.Empty(), timeout=10)


def test_another_release_gets_a_version_mismatch_not_a_crash(unix_server: Any) -> None:
    srv, fake = unix_server
    ch = grpc.insecure_channel(srv.address)
    with pytest.raises(grpc.RpcError) as ei:
        ch.unary_unary(f"/{SERVICE}/Run")(
            pb.RunRequest(job_id="x").SerializeToString(),
            metadata=[("snapshotter-version", "9.1.0"), ("snapshotter-peer", "cli")],
            timeout=10,
        )
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"version mismatch: coordinator v{__version__}, cli v9.1.0" in ei.value.details()
    assert fake.runs == 0


def test_health_and_reflection_answer_without_credentials(tmp_path: Path) -> None:
    tokens = TokenStore(tmp_path / "tokens.json")
    srv = _serve(Listen("127.0.0.1:0", tokens=tokens))
    try:
        ch = grpc.insecure_channel(srv.address)
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            st = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert st == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
            ProtoReflectionDescriptorDatabase,
        )

        db = ProtoReflectionDescriptorDatabase(ch)
        assert SERVICE in db.get_services()
        assert db.FindFileContainingSymbol(SERVICE).name == "snapshotter/v1/coordinator.proto"
    finally:
        srv.stop(0)


def test_unreachable_is_service_unavailable() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = coordinator_client(Target(f"127.0.0.1:{port}"))
    with pytest.raises(errors.ServiceUnavailable) as ei:
        c.stub.Ping(common_pb2.Empty(), timeout=5)
    assert f"127.0.0.1:{port}" in ei.value.cause


def test_the_cli_retries_a_call_that_never_reached_the_service(tmp_path: Path) -> None:
    """A CLI call whose connection failed (it never left this side) is sent again: a service
    that comes up a moment later answers it. A service's own calls are not retried."""
    import threading

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    tokens = TokenStore(tmp_path / "tokens.json")
    token = tokens.create("otto", Role.VIEWER, None)
    got: dict[str, Any] = {}

    def ping() -> None:
        try:
            c = coordinator_client(Target(f"127.0.0.1:{port}", token=token), peer="cli")
            got["pid"] = c.stub.Ping(common_pb2.Empty(), timeout=30).pid
        except errors.SnapshotterError as e:
            got["error"] = e

    t = threading.Thread(target=ping)
    t.start()
    time.sleep(0.15)  # the first try has failed by now: nothing listened
    srv = _serve(Listen(f"127.0.0.1:{port}", tokens=tokens))
    try:
        t.join(30)
        assert got == {"pid": 1}, got
    finally:
        srv.stop(0)
    with pytest.raises(errors.ServiceUnavailable):  # a service's call: failed at once
        coordinator_client(Target(f"127.0.0.1:{port}"), peer="agent").stub.Ping(
            common_pb2.Empty(), timeout=5)  # fmt: skip


# ---- where a service may listen -----------------------------------------------------------


def test_no_plaintext_beyond_loopback(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidArgument, match="refusing to serve the coordinator on "
                                                     "0.0.0.0:0 without TLS"):  # fmt: skip
        _serve(Listen("0.0.0.0:0"))
    with pytest.raises(errors.InvalidArgument, match="no token file"):
        _serve(Listen("127.0.0.1:0"))  # loopback without TLS needs tokens


def test_insecure_says_so_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    srv = _serve(Listen("127.0.0.1:0", insecure=True))
    srv.stop(0)
    assert "NO TLS and NO authentication" in capsys.readouterr().err


# ---- tokens and rights --------------------------------------------------------------------


@pytest.fixture()
def token_server(tmp_path: Path) -> Iterator[tuple[Served, Fake, TokenStore]]:
    tokens = TokenStore(tmp_path / "tokens.json")
    fake = Fake()
    srv = _serve(Listen("127.0.0.1:0", tokens=tokens), fake)
    yield srv, fake, tokens
    srv.stop(0)


def test_no_credential_is_refused(token_server: Any) -> None:
    srv, fake, _ = token_server
    with pytest.raises(errors.Unauthenticated, match="no credential"):
        coordinator_client(Target(srv.address)).stub.Run(pb.RunRequest(job_id="x"), timeout=10)
    assert fake.runs == 0


def test_a_viewer_token_may_look_but_not_freeze(token_server: Any) -> None:
    srv, fake, tokens = token_server
    c = coordinator_client(Target(srv.address, token=tokens.create("vera", Role.VIEWER, None)))
    assert c.stub.Ping(common_pb2.Empty(), timeout=10).pid == 1
    with pytest.raises(errors.PermissionDenied) as ei:
        list(c.stub.Freeze(pb.FreezeRequest(job_id="j"), timeout=10))
    assert ei.value.right == "OPERATE" and "vera (viewer, by token)" in ei.value.cause
    assert "operator" in ei.value.next_step
    with pytest.raises(errors.PermissionDenied, match="needs the OPERATE right"):
        c.stub.Run(pb.RunRequest(job_id="x"), timeout=10)
    assert fake.runs == 0
    op = coordinator_client(Target(srv.address, token=tokens.create("otto", Role.OPERATOR, None)))
    assert op.stub.Run(pb.RunRequest(job_id="x"), timeout=10).state == "RUNNING"


def test_stale_and_forged_tokens_are_refused(token_server: Any) -> None:
    srv, fake, tokens = token_server
    good = tokens.create("otto", Role.OPERATOR, ttl_s=1.0)
    ident = good.split(".")[0]
    forged = f"{ident}.{'x' * 43}"
    def ping(token: str) -> Any:
        return coordinator_client(Target(srv.address, token=token)).stub.Ping(
            common_pb2.Empty(), timeout=10
        )

    with pytest.raises(errors.Unauthenticated, match="unknown or forged"):
        ping(forged)
    with pytest.raises(errors.Unauthenticated, match="malformed"):
        ping("hunter2")
    time.sleep(1.2)
    with pytest.raises(errors.Unauthenticated, match="expired"):
        coordinator_client(Target(srv.address, token=good)).stub.Run(pb.RunRequest(), timeout=10)
    tokens.revoke(ident)
    assert fake.runs == 0


# ---- mutual TLS ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    one, other = tmp_path_factory.mktemp("ca1"), tmp_path_factory.mktemp("ca2")
    for d in (one, other):
        init_ca(d / "tls", ["a"], [("admin", "admin"), ("vera", "viewer"), ("box", "client")])
    return one / "tls", other / "tls"


def test_tls_roles_come_from_the_certificate(pki: tuple[Path, Path]) -> None:
    tls, _ = pki
    fake = Fake()
    srv = _serve(Listen("127.0.0.1:0", tls=TlsFiles.in_dir(tls, "coordinator")), fake)
    try:
        admin = coordinator_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "clients/admin")))
        assert admin.stub.Run(pb.RunRequest(job_id="x"), timeout=10).state == "RUNNING"
        viewer = coordinator_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "clients/vera")))
        with pytest.raises(errors.PermissionDenied, match="vera .viewer, by certificate."):
            viewer.stub.Run(pb.RunRequest(job_id="x"), timeout=10)
        # A machine certificate alone may connect but do nothing.
        box = coordinator_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "clients/box")))
        with pytest.raises(errors.PermissionDenied, match="needs the VIEW right"):
            box.stub.Ping(common_pb2.Empty(), timeout=10)
        assert fake.runs == 1
    finally:
        srv.stop(0)


def test_no_certificate_or_another_ca_fails_the_handshake_clearly(pki: tuple[Path, Path]) -> None:
    tls, other = pki
    fake = Fake()
    srv = _serve(Listen("127.0.0.1:0", tls=TlsFiles.in_dir(tls, "coordinator")), fake)
    try:
        stranger = coordinator_client(
            Target(srv.address, tls=TlsFiles.in_dir(other, "clients/admin"))
        )
        with pytest.raises(errors.ServiceUnavailable, match="TLS handshake .* failed") as ei:
            stranger.stub.Run(pb.RunRequest(job_id="x"), timeout=10)
        assert "same CA" in ei.value.next_step
        plain = coordinator_client(Target(srv.address))  # no TLS at all
        with pytest.raises(errors.ServiceUnavailable):
            plain.stub.Run(pb.RunRequest(job_id="x"), timeout=10)
        assert fake.runs == 0
        ok = coordinator_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "clients/admin")))
        assert ok.stub.Ping(common_pb2.Empty(), timeout=10).pid == 1  # still serving
    finally:
        srv.stop(0)


# ---- the agent --------------------------------------------------------------------------


@pytest.fixture()
def agent(tmp_path: Path, pki: tuple[Path, Path]) -> Iterator[tuple[Served, NodeAgent, Path]]:
    tls, _ = pki
    home = tmp_path / "home"
    settings = NodeSettings(
        name="a", paths=Paths(home), freeze_lease_s=0,
        policy=ExecPolicy.default([], [str(tmp_path / "jobs")]),
    )  # fmt: skip
    node = NodeAgent(settings, LocalDirStore(tmp_path / "store"))
    srv = serve("agent", Listen("127.0.0.1:0", tls=TlsFiles.in_dir(tls, "nodes/a")),
                agent_service.register(node), [agent_service.SERVICE])  # fmt: skip
    yield srv, node, tls
    srv.stop(0)
    node.shutdown()


def _launch(spec: common_pb2.JobSpec) -> agent_pb2.LaunchRequest:
    return agent_pb2.LaunchRequest(spec=spec, node_rank=0)


def _spec(tmp_path: Path, python: str, cwd: Path) -> common_pb2.JobSpec:
    cwd.mkdir(parents=True, exist_ok=True)
    return common_pb2.JobSpec(
        job_id="j1", script=str(cwd / "x.py"), python=python, cwd=str(cwd), nnodes=1,
        nproc_per_node=1,
    )  # fmt: skip


def test_the_agent_drives_only_for_the_coordinator(agent: Any, tmp_path: Path) -> None:
    srv, node, tls = agent
    spec = _spec(tmp_path, sys.executable, tmp_path / "jobs")
    admin = agent_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "clients/admin"),
                                server_name="a"))  # fmt: skip
    assert admin.stub.Ping(common_pb2.Empty(), timeout=10).node == "a"  # viewing is fine
    with pytest.raises(errors.PermissionDenied, match="needs the DRIVE right"):
        admin.stub.Launch(_launch(spec), timeout=10)
    no_cert = agent_client(Target(srv.address, server_name="a"))
    with pytest.raises(errors.ServiceUnavailable):
        no_cert.stub.Launch(_launch(spec), timeout=10)
    assert node.jobs.all() == []


def test_the_agent_runs_only_allowed_interpreters_and_directories(
    agent: Any, tmp_path: Path
) -> None:
    srv, node, tls = agent
    coord = agent_client(Target(srv.address, tls=TlsFiles.in_dir(tls, "coordinator"),
                                server_name="a"))  # fmt: skip
    with pytest.raises(errors.PermissionDenied, match="/bin/sh is not allowed") as ei:
        coord.stub.Launch(_launch(_spec(tmp_path, "/bin/sh", tmp_path / "jobs")), timeout=10)
    assert "--allow-python /bin/sh" in ei.value.next_step
    outside = tmp_path / "elsewhere"
    with pytest.raises(errors.PermissionDenied, match="is not under any of them") as ei:
        coord.stub.Launch(_launch(_spec(tmp_path, sys.executable, outside)), timeout=10)
    assert f"--allow-cwd {outside}" in ei.value.next_step
    sneaky = tmp_path / "jobs" / ".." / "elsewhere"
    with pytest.raises(errors.PermissionDenied):
        coord.stub.Launch(_launch(_spec(tmp_path, sys.executable, sneaky)), timeout=10)
    assert node.jobs.all() == [] and not (node.paths.home / "sandbox").exists()
    assert coord.stub.Ping(common_pb2.Empty(), timeout=10).node == "a"


def test_the_agent_reports_what_nvml_saw(tmp_path: Path) -> None:
    """A GPU fault reaches the agent's Ping (and, for a job started before it, Status)."""
    from snapshotter.gpu.health import GpuHealth
    from snapshotter.testing.nvml_fake import FakeDevice, FakeNvml

    nvml = FakeNvml([FakeDevice("GPU-0"), FakeDevice("GPU-1")])
    settings = NodeSettings(name="a", paths=Paths(tmp_path / "home"),
                            gpu_health=lambda: GpuHealth(nvml, poll_s=0.05).start())  # fmt: skip
    node = NodeAgent(settings, LocalDirStore(tmp_path / "store"))
    try:
        assert list(node.info().gpu_faults) == []
        nvml.xid(1, 79)
        deadline = time.monotonic() + 10
        while not node.info().gpu_faults:
            assert time.monotonic() < deadline, "the fault never reached the agent"
            time.sleep(0.05)
        (f,) = node.info().gpu_faults
        assert (f.uuid, f.code, f.fatal) == ("GPU-1", 79, True)
        assert node.gpu_faults(since=f.time + 1) == []  # a job started later is not blamed
    finally:
        node.shutdown()
    with pytest.raises(nvml.UninitializedError):  # the agent's shutdown closed NVML
        nvml.device_get_count_v2()
