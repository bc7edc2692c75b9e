"""The gRPC transport: real in-process servers; errors keep their type across the wire."""

from collections.abc import Iterator

import pytest

from snapshotter import errors
from snapshotter.rpc.wire import Client, Server


@pytest.fixture()
def server() -> Iterator[Server]:
    srv = Server("127.0.0.1:0")

    def echo(req: dict) -> dict:
        return {"echo": req}

    def fail(req: dict) -> dict:
        raise errors.FreezeRefused("busy job", "wait")

    def boom(req: dict) -> dict:
        raise ValueError("bug")

    def count(req: dict) -> Iterator[dict]:
        for i in range(int(req["n"])):
            yield {"i": i}
        raise errors.SnapshotCorrupt("chunk 3 bad", "delete it")

    srv.add_service("t.S", {"Echo": echo, "Fail": fail, "Boom": boom}, {"Count": count})
    srv.start()
    yield srv
    srv.stop(0)


@pytest.mark.timeout(30)
def test_roundtrip_and_typed_errors(server: Server) -> None:
    c = Client(server.address, "t.S")
    assert c.call("Echo", {"a": [1, "x"]}) == {"echo": {"a": [1, "x"]}}
    with pytest.raises(errors.FreezeRefused) as ei:
        c.call("Fail")
    assert ei.value.cause == "busy job" and ei.value.next_step == "wait"
    with pytest.raises(errors.Internal) as ei2:
        c.call("Boom")
    assert "ValueError: bug" in ei2.value.cause


@pytest.mark.timeout(30)
def test_stream_yields_then_raises_typed_error(server: Server) -> None:
    c = Client(server.address, "t.S")
    got = []
    with pytest.raises(errors.SnapshotCorrupt):
        for ev in c.stream("Count", {"n": 3}):
            got.append(ev["i"])
    assert got == [0, 1, 2]


@pytest.mark.timeout(30)
def test_unreachable_is_service_unavailable() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = Client(f"127.0.0.1:{port}", "t.S")
    with pytest.raises(errors.ServiceUnavailable) as ei:
        c.call("Echo", {}, timeout=5)
    assert f"127.0.0.1:{port}" in ei.value.cause
