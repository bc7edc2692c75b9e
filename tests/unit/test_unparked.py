"""What a freeze's error says about a rank that did not park: the rank's threads as the hook
reads them (hook/stacks.py), carried in a progress report (hook/protocol.py) and put in one
line by the agent (agent/unparked.py)."""

from __future__ import annotations

import threading

import pytest

from snapshotter.agent.unparked import unparked
from snapshotter.hook import protocol, stacks
from snapshotter.hook.protocol import LineDecoder, ProtocolError

pytestmark = pytest.mark.timeout(10)
CAUSE = "rank 1 did not answer 'parked' within 60s"


def wire(msg: protocol.Msg) -> protocol.Msg:
    (line,) = LineDecoder().feed(protocol.encode(msg))
    return protocol.decode(line)


def test_where_is_asked_for_only_when_wanted() -> None:
    assert "where" not in wire(protocol.progress(3))
    assert wire(protocol.progress(3, where=True))["where"] is True


def _waits_for_an_upload(release: threading.Event) -> None:
    release.wait(10)


def test_each_other_thread_is_named_with_the_function_it_waits_in() -> None:
    release = threading.Event()
    t = threading.Thread(target=_waits_for_an_upload, args=(release,), name="dcp-save")
    t.start()
    try:
        lines = stacks.where()
    finally:
        release.set()
        t.join()
    (line,) = [w for w in lines if w.startswith("dcp-save: ")]
    # Innermost first: the Event's wait, then the function that called it.
    assert " wait < " in line and "_waits_for_an_upload" in line, line
    assert "test_unparked.py:" in line, line
    assert not any(w.startswith("MainThread") for w in lines), "the caller's own thread"


def test_where_travels_in_a_progress_report_and_is_bounded() -> None:
    many = [f"t{i}: x.py:1 f" + "y" * 1000 for i in range(50)]
    seen = protocol.progress_of(wire(protocol.progress_report(3, 1, {"0": 2}, where=many)))
    assert len(seen.where) == protocol.MAX_WHERE
    assert all(len(w) == protocol.MAX_WHERE_CHARS for w in seen.where)
    assert seen.where[0].startswith("t0: x.py:1 f")
    bad = {**protocol.progress_report(3, 1, {}), "where": "not a list"}
    with pytest.raises(ProtocolError, match="where"):
        protocol.progress_of(bad)


def test_a_rank_behind_on_a_group_is_named_with_its_threads() -> None:
    seen = protocol.Progress(
        query=1, steps=12, counts={"0": 25, "1": 34}, state="armed", in_flight_s=0.0,
        where=("MainThread: barrier.py:180 enter < train.py:80 main",
               "save: spool.py:240 _via_agent < dcp.py:170 write_data"),
    )  # fmt: skip
    line = unparked(CAUSE, {"0": 26, "1": 36}, seen)
    assert line.startswith(CAUSE + "; its barrier is armed; ")
    assert "group 1 issued 34 of the 35 another rank issued" in line
    assert "group 0" not in line  # it reached what the others reached
    assert "in flight" not in line
    assert "threads: MainThread: barrier.py:180 enter < train.py:80 main | save: " in line


def test_a_rank_waiting_on_a_peer_says_how_long_its_collective_has_been_in_flight() -> None:
    seen = protocol.Progress(query=1, steps=12, counts={"0": 25}, state="armed",
                             in_flight_s=58.4)  # fmt: skip
    line = unparked(CAUSE, {"0": 26}, seen)
    assert "no group behind the others" in line
    assert "a collective in flight for 58s" in line
    assert "threads" not in line


def test_a_rank_that_does_not_answer_is_said_to_be_unresponsive() -> None:
    line = unparked(CAUSE, {"0": 26}, None)
    assert line.startswith(CAUSE + "; it did not answer a progress query")
