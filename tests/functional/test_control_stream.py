"""Unary calls carried by one Control stream (snapshotter/rpc/control.py), through the real
server checks (rpc/server.py) on a real gRPC server on 127.0.0.1 with bearer tokens and a
fence: each message is checked, audited and answered as the call it stands for, a failure comes
back as the same typed error, a deadline and a broken stream fail the calls waiting, and an
agent of an earlier release (no Control) is called with calls of their own."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory

from snapshotter import errors, metrics
from snapshotter.agent.fencing import Fence
from snapshotter.agent.service import SERVICE, fence_check
from snapshotter.rpc import control
from snapshotter.rpc.aio import LOOP, AioClient
from snapshotter.rpc.auth import Role, TokenStore
from snapshotter.rpc.client import Target
from snapshotter.rpc.server import Listen, Served, caller_active, serve
from snapshotter.v1 import agent_pb2, agent_pb2_grpc, common_pb2

AGENT = agent_pb2.DESCRIPTOR.services_by_name["Agent"]


class Servicer(agent_pb2_grpc.AgentServicer):
    """Answers Ping and Status (VIEW) and Cancel (DRIVE); Cancel of job "slow" takes 1.5 s
    and records whether its caller was still there at the end."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.active_after_slow: list[bool] = []

    def Ping(self, request: Any, context: Any) -> common_pb2.AgentInfo:
        self.calls.append("Ping")
        return common_pb2.AgentInfo(node="n1", pid=threading.get_ident())

    def Status(self, request: common_pb2.JobRef, context: Any) -> agent_pb2.NodeJob:
        self.calls.append("Status")
        if request.job_id != "j1":
            raise errors.JobNotFound(request.job_id)
        return agent_pb2.NodeJob(job_id="j1", state="RUNNING", node="n1")

    def Cancel(self, request: common_pb2.JobRef, context: Any) -> agent_pb2.NodeJob:
        self.calls.append("Cancel")
        if request.job_id == "slow":
            time.sleep(1.5)
            self.active_after_slow.append(caller_active())
        return agent_pb2.NodeJob(job_id=request.job_id, state="CANCELLED", node="n1")


    def KeepFreeze(self, request: agent_pb2.FreezeRef, context: Any) -> Any:
        self.calls.append("KeepFreeze")
        return agent_pb2.KeepFreezeReply(known=request.freeze_id == "frz-1")


class Agent:
    def __init__(self, tmp: Path, address: str = "127.0.0.1:0") -> None:
        self.tokens = TokenStore(tmp / "tokens.json")
        self.coord_token = self.tokens.create("coordinator", Role.COORDINATOR, None)
        self.viewer_token = self.tokens.create("viewer", Role.VIEWER, None)
        self.servicer = Servicer()
        self.fence = Fence()
        self.served: Served = self._serve(address)
        self.address = self.served.address

    def _serve(self, address: str) -> Served:
        return serve("agent", Listen(address, tokens=self.tokens),
                     lambda s: agent_pb2_grpc.add_AgentServicer_to_server(self.servicer, s),
                     [SERVICE], extra_check=fence_check(self.fence))  # fmt: skip

    def restart(self) -> None:
        self.served.stop(0)
        self.served = self._serve(self.address)

    def client(self, token: str | None = None, epoch: int = 2) -> AioClient:
        t = Target(self.address, token=self.coord_token if token is None else token,
                   fence=(epoch, "c1"))  # fmt: skip
        return AioClient(t, agent_pb2_grpc.AgentStub, "coordinator", "agent", AGENT)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    a = Agent(tmp_path)
    try:
        yield a
    finally:
        a.served.stop(0)


def run(c: AioClient, method: str, request: Any, timeout: float | None = 10) -> Any:
    async def go() -> Any:
        return await c.call(method, request, timeout)

    return LOOP.run(go())


def outcome(c: AioClient, method: str, request: Any, timeout: float | None = 10) -> Any:
    try:
        return run(c, method, request, timeout)
    except errors.SnapshotterError as e:
        return e


def streams_open() -> float:
    return metrics.RPC["agent"].in_flight.labels("Control")._value.get()  # type: ignore[no-any-return]


def test_many_calls_ride_one_stream_and_answer_as_calls_of_their_own(agent: Agent) -> None:
    c = agent.client()
    before = streams_open()
    try:
        async def many() -> list[Any]:
            job = common_pb2.JobRef(job_id="j1")
            return await asyncio.gather(*(c.call("Status", job, 10) for _ in range(50)),
                                        c.call("Ping", common_pb2.Empty(), 10))  # fmt: skip

        replies = LOOP.run(many())
        assert [r.job_id for r in replies[:50]] == ["j1"] * 50
        assert replies[50].node == "n1"
        assert c._control is not None and c._control.supported
        assert streams_open() == before + 1  # one stream carried all 51
        assert agent.servicer.calls.count("Status") == 50
        # Counted under the method each message stands for, not as one call of Control.
        ok = metrics.AGENT.get_sample_value("snapshotter_rpc_seconds_count",
                                            {"method": "Status", "code": "ok"})  # fmt: skip
        assert ok is not None and ok >= 50
        # The same reply a call of its own gets.
        plain = agent.client()
        plain._control_service = None
        assert run(plain, "Status", common_pb2.JobRef(job_id="j1")) == replies[0]
        plain.close()
    finally:
        c.close()


def test_a_handlers_error_arrives_typed_and_the_stream_goes_on(agent: Agent) -> None:
    c = agent.client()
    try:
        err = outcome(c, "Status", common_pb2.JobRef(job_id="nope"))
        assert isinstance(err, errors.JobNotFound) and err.job_id == "nope", err
        assert run(c, "Status", common_pb2.JobRef(job_id="j1")).state == "RUNNING"
    finally:
        c.close()


def test_each_message_needs_its_own_right_and_the_current_fence(agent: Agent) -> None:
    viewer = agent.client(token=agent.viewer_token)
    coord, stale = agent.client(epoch=5), agent.client(epoch=4)
    try:
        # The viewer may open the stream (VIEW) and Ping, but not Cancel (DRIVE) through it.
        assert run(viewer, "Ping", common_pb2.Empty()).node == "n1"
        err = outcome(viewer, "Cancel", common_pb2.JobRef(job_id="j1"))
        assert isinstance(err, errors.PermissionDenied), err
        assert run(viewer, "Ping", common_pb2.Empty()).node == "n1"
        # Epoch 5 raises the bar; epoch 4's stream is then refused DRIVE calls, one by one.
        assert run(coord, "Cancel", common_pb2.JobRef(job_id="j1")).state == "CANCELLED"
        err = outcome(stale, "Cancel", common_pb2.JobRef(job_id="j1"))
        assert isinstance(err, errors.Fenced), err
        assert agent.servicer.calls.count("Cancel") == 1
    finally:
        for c in (viewer, coord, stale):
            c.close()


def test_no_credential_refuses_the_stream_itself(agent: Agent) -> None:
    c = AioClient(Target(agent.address), agent_pb2_grpc.AgentStub, "coordinator", "agent", AGENT)
    try:
        err = outcome(c, "Ping", common_pb2.Empty())
        assert isinstance(err, errors.Unauthenticated), err
        assert "no credential" in err.cause
        assert agent.servicer.calls == []
    finally:
        c.close()


def test_a_node_may_open_the_stream_for_what_it_may_call_and_a_bare_client_may_not(
    agent: Agent,
) -> None:
    """The stream's own right is VIEW, or the right of a call it can carry (a node relaying
    carries TRANSFER calls, rpc/relay.py); a role with no right of the service's holds none."""
    node = agent.client(token=agent.tokens.create("node-b", Role.NODE, None))
    bare = agent.client(token=agent.tokens.create("machine", Role.CLIENT, None))
    try:
        # Opened: the node's DRIVE call on it is refused by that call's own right.
        err = outcome(node, "Cancel", common_pb2.JobRef(job_id="j1"))
        assert isinstance(err, errors.PermissionDenied) and "DRIVE" in err.cause, err
        assert node._control is not None and node._control.supported
        assert "VIEW" not in err.cause  # not the stream's refusal: the carried call's
        # The bare client is refused the stream itself (it names the stream's right).
        err = outcome(bare, "Ping", common_pb2.Empty())
        assert isinstance(err, errors.PermissionDenied) and "Control" in err.cause, err
        assert agent.servicer.calls == []
    finally:
        node.close()
        bare.close()


def test_what_no_unary_call_could_be_is_refused(agent: Agent) -> None:
    """Raw messages on the stream: a streaming method, Control itself, an unknown or
    ill-formed name, a request of the wrong type."""
    ch = grpc.insecure_channel(agent.address)
    md = (("authorization", f"Bearer {agent.coord_token}"), ("snapshotter-fence", "2:c1"))
    stub = agent_pb2_grpc.AgentStub(ch)
    ref = common_pb2.JobRef(job_id="j1").SerializeToString()
    asks = [
        agent_pb2.ControlRequest(id=1, method="Upload", request=b""),
        agent_pb2.ControlRequest(id=2, method="Control", request=b""),
        agent_pb2.ControlRequest(id=3, method="NoSuch", request=b""),
        agent_pb2.ControlRequest(id=4, method="../Agent/Ping", request=b""),
        agent_pb2.ControlRequest(id=5, method="Status", request=b"\xff\xff\xff"),
        agent_pb2.ControlRequest(id=6, method="Status", request=ref),
    ]
    try:
        replies = {r.id: r for r in stub.Control(iter(asks), metadata=md, timeout=20)}
    finally:
        ch.close()
    assert sorted(replies) == [1, 2, 3, 4, 5, 6]
    for i in (1, 2, 3, 4):
        assert replies[i].error.code == "invalid_argument", replies[i]
        assert "is not a unary method of snapshotter.v1.Agent" in replies[i].error.cause
    assert replies[5].error.code == "invalid_argument"
    assert "malformed request" in replies[5].error.cause
    assert agent_pb2.NodeJob.FromString(replies[6].reply).job_id == "j1"
    assert agent.servicer.calls == ["Status"]


def test_a_deadline_fails_the_call_alone_and_the_handler_sees_it_pass(agent: Agent) -> None:
    c = agent.client()
    try:
        t0 = time.monotonic()
        err = outcome(c, "Cancel", common_pb2.JobRef(job_id="slow"), timeout=0.3)
        assert isinstance(err, errors.ServiceUnavailable), err
        assert "Cancel on" in err.cause and "did not answer within its deadline" in err.cause
        assert time.monotonic() - t0 < 1.4  # it did not wait for the handler
        assert run(c, "Ping", common_pb2.Empty()).node == "n1"
        deadline = time.monotonic() + 10
        while not agent.servicer.active_after_slow and time.monotonic() < deadline:
            time.sleep(0.05)
        # As for a unary call past its deadline: the handler learns its caller has gone.
        assert agent.servicer.active_after_slow == [False]
    finally:
        c.close()


def test_a_broken_stream_fails_the_waiting_call_and_the_next_call_opens_another(
    agent: Agent,
) -> None:
    c = agent.client()
    try:
        assert run(c, "Ping", common_pb2.Empty()).node == "n1"
        failed: list[Any] = []
        t = threading.Thread(target=lambda: failed.append(
            outcome(c, "Cancel", common_pb2.JobRef(job_id="slow"), timeout=30)))  # fmt: skip
        t.start()
        time.sleep(0.5)  # the call is in the handler
        agent.restart()  # the agent goes away and comes back at the same address
        t.join(20)
        assert len(failed) == 1 and isinstance(failed[0], errors.ServiceUnavailable), failed
        reply: Any = None
        for _ in range(50):  # the channel reconnects within its backoff
            reply = outcome(c, "Ping", common_pb2.Empty())
            if not isinstance(reply, errors.SnapshotterError):
                break
            time.sleep(0.2)
        assert getattr(reply, "node", None) == "n1", reply
    finally:
        c.close()


def _without_control(servicer: Servicer, server: grpc.Server) -> None:
    """The Agent service as a server that never had Control registers it: Ping and Status."""
    handlers = {}
    for name in ("Ping", "Status"):
        m = AGENT.methods_by_name[name]
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name),
            request_deserializer=message_factory.GetMessageClass(m.input_type).FromString,
            response_serializer=lambda r: r.SerializeToString(),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(AGENT.full_name, handlers),))  # fmt: skip


def _control_unimplemented(servicer: Servicer, server: grpc.Server) -> None:
    """The generated servicer's Control, which answers UNIMPLEMENTED."""
    agent_pb2_grpc.add_AgentServicer_to_server(servicer, server)


@pytest.mark.parametrize("register", [_without_control, _control_unimplemented],
                         ids=["not-registered", "answers-unimplemented"])  # fmt: skip
def test_an_agent_without_control_is_called_with_calls_of_their_own(
    tmp_path: Path, register: Callable[[Servicer, grpc.Server], None]
) -> None:
    """An agent of an earlier release: its server has no Control (UNIMPLEMENTED). Many
    clients, each with its first call: a message written on a stream the server has refused made
    grpc end it with INTERNAL, not UNIMPLEMENTED, now and then (grpc/grpc#36066); the
    caller writes nothing before the server says it serves Control."""
    servicer = Servicer()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(4))
    register(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    clients = [AioClient(Target(f"127.0.0.1:{port}"), agent_pb2_grpc.AgentStub,
                         "coordinator", "agent", AGENT) for _ in range(20)]  # fmt: skip
    try:
        # One after another, each the first call on a new channel (as a coordinator's first
        # call to each agent): concurrent ones hid the race when reproduced here.
        replies = [outcome(c, "Ping", common_pb2.Empty()) for c in clients]
        assert [getattr(r, "node", r) for r in replies] == ["n1"] * len(clients)
        for c in clients:
            assert c._control is not None and not c._control.supported
        err = outcome(clients[0], "Status", common_pb2.JobRef(job_id="nope"))
        assert isinstance(err, errors.SnapshotterError)  # a plain server sends no detail
        assert servicer.calls == ["Ping"] * len(clients) + ["Status"]
    finally:
        for c in clients:
            c.close()
        server.stop(0)


def test_calls_in_flight_on_one_stream_are_bounded(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "MAX_IN_FLIGHT", 2)
    c = agent.client()
    try:
        async def four() -> list[Any]:
            slow = common_pb2.JobRef(job_id="slow")
            return await asyncio.gather(*(c.call("Cancel", slow, 20) for _ in range(4)),
                                        return_exceptions=True)  # fmt: skip

        got = LOOP.run(four())
        refused = [g for g in got if isinstance(g, errors.ServiceUnavailable)]
        assert len(refused) == 2, got
        assert "2 calls are already in flight" in refused[0].cause
        assert sum(1 for g in got if getattr(g, "state", "") == "CANCELLED") == 2
    finally:
        c.close()


def test_a_retired_handle_ends_its_stream_and_calls_on_without_one(agent: Agent) -> None:
    c = agent.client()
    before = streams_open()
    try:
        assert run(c, "Ping", common_pb2.Empty()).node == "n1"
        assert streams_open() == before + 1
        c.end_stream()
        deadline = time.monotonic() + 10
        while streams_open() != before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert streams_open() == before  # the agent's thread for it is free again
        assert run(c, "Status", common_pb2.JobRef(job_id="j1")).job_id == "j1"
        assert streams_open() == before  # a call of its own, no new stream
    finally:
        c.close()


def test_a_deadline_that_is_no_number_is_no_deadline(agent: Agent) -> None:
    ch = grpc.insecure_channel(agent.address)
    md = (("authorization", f"Bearer {agent.coord_token}"), ("snapshotter-fence", "2:c1"))
    slow = common_pb2.JobRef(job_id="slow").SerializeToString()
    asks = [agent_pb2.ControlRequest(id=i, method="Cancel", request=slow, timeout_s=t)
            for i, t in enumerate((float("nan"), float("-inf"), -1.0), start=1)]  # fmt: skip
    try:
        replies = list(agent_pb2_grpc.AgentStub(ch).Control(iter(asks), metadata=md, timeout=20))
    finally:
        ch.close()
    assert sorted(r.id for r in replies) == [1, 2, 3]
    assert all(agent_pb2.NodeJob.FromString(r.reply).state == "CANCELLED" for r in replies)
    # Their handlers ran to the end with their caller still there.
    assert agent.servicer.active_after_slow == [True, True, True]


def test_a_freezes_lease_renewals_ride_the_stream(agent: Agent) -> None:
    """coordinator/freeze.py renews an idle node's lease with calls on the event loop, carried
    by the node's Control stream: no thread per renewal."""
    from snapshotter.coordinator.freeze import FreezeOperation, FreezeSettings
    from snapshotter.launch.spec import JobSpec

    c = agent.client()
    handle = SimpleNamespace(name="n1", incarnation="", aio=c, target=Target(agent.address))
    spec = JobSpec("j1", "t.py", [], False, "python", "/", {})
    op = FreezeOperation(spec, [handle], store=None, stop=False,  # type: ignore[arg-type, list-item]
                         settings=FreezeSettings(keepalive_s=0.2), on_committed=print)  # fmt: skip
    op.freeze_id = "frz-1"
    before = streams_open()
    done = threading.Event()
    op._keep_alive(done)
    try:
        deadline = time.monotonic() + 10
        while agent.servicer.calls.count("KeepFreeze") < 3:
            assert time.monotonic() < deadline, agent.servicer.calls
            time.sleep(0.05)
        assert streams_open() == before + 1  # carried by the one stream, which stays open
    finally:
        done.set()
        c.close()
