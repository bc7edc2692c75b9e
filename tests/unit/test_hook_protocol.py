"""The control protocol's builders and readers (snapshotter/hook/protocol.py): pure, no I/O."""

from __future__ import annotations

import pytest

from snapshotter.hook import protocol
from snapshotter.hook.protocol import LineDecoder, ProtocolError

pytestmark = pytest.mark.timeout(10)


def wire(msg: protocol.Msg) -> protocol.Msg:
    """`msg` as the other end reads it."""
    (line,) = LineDecoder().feed(protocol.encode(msg))
    return protocol.decode(line)


def test_progress_is_a_command_answered_by_its_own_op() -> None:
    cmd = wire(protocol.progress(7))
    assert cmd == {"op": "progress", "query": 7}
    assert protocol.REPLY_TO[cmd["op"]] == "progress"
    assert protocol.query_of(cmd) == 7


def test_a_progress_report_reads_back_as_it_was_built() -> None:
    msg = wire(protocol.progress_report(7, 42, {"0": 84, "0|p2p:0>1": 3}, "suspended", 2.5))
    assert msg == {"op": "progress", "query": 7, "steps": 42,
                   "counts": {"0": 84, "0|p2p:0>1": 3}, "state": "suspended",
                   "in_flight_s": 2.5}  # fmt: skip
    assert "freeze" not in msg  # never matched as, nor mistaken for, a freeze's reply
    assert protocol.progress_of(msg) == protocol.Progress(
        7, 42, {"0": 84, "0|p2p:0>1": 3}, "suspended", 2.5
    )


def test_a_progress_report_of_an_older_hook_has_no_state() -> None:
    msg = {"op": "progress", "query": 7, "steps": 42, "counts": {}}
    assert protocol.progress_of(msg).state == ""


def test_a_rank_with_no_group_reports_empty_counts() -> None:
    assert protocol.progress_of(wire(protocol.progress_report(1, 0, {}))).counts == {}


@pytest.mark.parametrize(
    "msg",
    [
        {"op": "counts", "query": 1, "steps": 1, "counts": {}},
        {"op": "progress", "steps": 1, "counts": {}},
        {"op": "progress", "query": "x", "steps": 1, "counts": {}},
        {"op": "progress", "query": 1, "counts": {}},
        {"op": "progress", "query": 1, "steps": None, "counts": {}},
        {"op": "progress", "query": 1, "steps": 1},
        {"op": "progress", "query": 1, "steps": 1, "counts": [1]},
        {"op": "progress", "query": 1, "steps": 1, "counts": {"0": "many"}},
    ],
)
def test_a_malformed_progress_reply_is_a_protocol_error(msg: protocol.Msg) -> None:
    with pytest.raises(ProtocolError):
        protocol.progress_of(msg)


def test_a_progress_command_without_a_query_number_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="query"):
        protocol.query_of({"op": "progress"})
