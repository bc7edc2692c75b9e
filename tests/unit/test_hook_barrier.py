"""The quiesce barrier's state machine, without processes, on both implementations: the Python
reference (`QuiesceBarrier`) and the native gate of csrc/gate.cpp (through `NativeBarrier`,
which needs the torch it was built against imported)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from snapshotter.hook import native
from snapshotter.hook.barrier import BarrierError, ParkPoint, QuiesceBarrier, State, channel

pytestmark = pytest.mark.timeout(10)

_IMPL = {"name": "python"}


@pytest.fixture(autouse=True, params=["python", "native"])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "native":
        pytest.importorskip("torch")
        if native.load() is None:
            pytest.fail("the native hook is not built: python -m snapshotter.hook.native --build")
    _IMPL["name"] = request.param
    return str(request.param)


def test_the_native_channel_key_is_the_reference_one(impl: str) -> None:
    if impl == "native":
        ext: Any = native.load()
        assert ext.channel("g", 1, 0) == channel("g", 1, 0)


class Recorder:
    def __init__(self) -> None:
        self.parked: list[tuple[str, ParkPoint | None]] = []
        self.event = threading.Event()

    def __call__(self, freeze: str, at: ParkPoint | None) -> None:
        self.parked.append((freeze, at))
        self.event.set()


def make(*groups: str) -> tuple[Any, Recorder]:
    rec = Recorder()
    b: Any = (
        native.NativeBarrier(native.load(), rec)  # type: ignore[arg-type]
        if _IMPL["name"] == "native"
        else QuiesceBarrier(rec)
    )
    for g in groups:
        b.add_group(g)
    return b, rec


class Op:
    """A stand-in for an issued op: done once `finish` is called. Like a gloo send, a
    `wait_only` op reports done only to whoever waited for it (`settle`)."""

    def __init__(self, wait_only: bool = False) -> None:
        self.finished = threading.Event()
        self.wait_only = wait_only
        self.settled = False
        self.settles = 0

    def finish(self) -> None:
        self.finished.set()

    def done(self) -> bool:
        return self.settled if self.wait_only else self.finished.is_set()

    def settle(self) -> None:
        self.settles += 1
        if self.wait_only:
            self.finished.wait()
            self.settled = True
        else:
            self.finished.wait(0.001)


def issue(b: Any, key: str, n: int) -> None:
    for _ in range(n):
        b.enter(key)


def test_counts_every_issued_collective_per_group() -> None:
    b, _ = make("0", "1")
    issue(b, "0", 3)
    issue(b, "1", 1)
    assert b.counts() == {"0": 3, "1": 1}


def test_no_group_parks_at_once_with_no_point() -> None:
    b, rec = make()
    b.prepare("f")
    b.arm("f", {})
    assert rec.parked == [("f", None)] and b.state is State.PARKED


def test_parks_before_target_and_resumes_after_release() -> None:
    b, rec = make("0")
    issue(b, "0", 2)
    b.arm("f", {"0": 3})
    seqs: list[int] = []
    t = threading.Thread(target=lambda: seqs.append(b.enter("0")))
    t.start()
    assert rec.event.wait(5)
    assert rec.parked == [("f", ParkPoint("0", 3))]
    assert b.state is State.PARKED and seqs == []
    b.suspend("f")
    b.release("f")
    t.join(5)
    assert seqs == [3] and b.state is State.IDLE


def test_not_quiesced_while_a_collective_is_in_flight() -> None:
    b, rec = make("0")
    b.enter("0")
    op = Op()
    b.track(op)  # in flight
    b.arm("f", {"0": 2})
    t = threading.Thread(target=b.enter, args=("0",))
    t.start()
    assert not rec.event.wait(0.2)
    assert b.state is State.ARMED and op.settles > 0  # the parker polls it
    op.finish()  # the last one finishes: the parker sees it and reports quiesced
    assert rec.event.wait(5)
    assert rec.parked == [("f", ParkPoint("0", 2))]
    b.abort("f")
    t.join(5)
    assert b.counts() == {"0": 2}


def test_reports_how_long_its_oldest_op_has_been_in_flight() -> None:
    b, _ = make("0")
    assert b.oldest_in_flight_s() == 0.0
    old, new = Op(), Op()
    b.enter("0")
    b.track(old)
    time.sleep(0.3)
    before_new = time.monotonic()
    b.enter("0")
    b.track(new)
    assert 0.3 <= b.oldest_in_flight_s()
    old.finish()
    # Now the age of `new`: no more than the time since just before it was tracked (a
    # loaded machine may take any time between these lines, so no fixed bound).
    assert b.oldest_in_flight_s() <= time.monotonic() - before_new
    new.finish()
    assert b.oldest_in_flight_s() == 0.0


def test_the_parker_waits_out_a_send_only_a_waiter_sees_complete() -> None:
    b, rec = make("0")
    send = channel("0", 0, 1)
    b.enter(send)
    op = Op(wait_only=True)
    b.track(op)  # an isend its peer has not received yet
    b.arm("f", {"0": 1, send: 2})
    t = threading.Thread(target=b.enter, args=("0",))
    t.start()
    assert not rec.event.wait(0.2)
    op.finish()  # the peer's irecv matched it
    assert rec.event.wait(5) and op.settled
    assert rec.parked == [("f", ParkPoint("0", 1))]
    b.abort("f")
    t.join(5)


def test_point_to_point_counts_per_channel_apart_from_collectives() -> None:
    b, _ = make("0")
    issue(b, channel("0", 0, 1), 3)
    issue(b, channel("0", 1, 0), 2)
    issue(b, "0", 1)
    assert b.counts() == {"0": 1, "0|p2p:0>1": 3, "0|p2p:1>0": 2}
    with pytest.raises(BarrierError, match="unknown or destroyed"):
        b.enter(channel("9", 0, 1))  # a channel of a group that does not exist
    b.remove_group("0")
    assert b.counts() == {}


def test_a_channel_not_used_yet_still_binds_at_its_target() -> None:
    b, rec = make("0")
    recv = channel("0", 1, 0)
    b.arm("f", {"0": 4, recv: 1})  # its peer sent nothing: not even one receive may start
    seqs: list[int] = []
    t = threading.Thread(target=lambda: seqs.append(b.enter(recv)))
    t.start()
    assert rec.event.wait(5) and rec.parked == [("f", ParkPoint(recv, 1))]
    assert seqs == []
    b.abort("f")
    t.join(5)
    assert seqs == [1]


def test_prepare_holds_new_collectives_until_arm() -> None:
    b, rec = make("0")
    assert b.prepare("f") == {"0": 0}
    seqs: list[int] = []
    t = threading.Thread(target=lambda: seqs.append(b.enter("0")))
    t.start()
    t.join(0.2)
    assert t.is_alive() and seqs == []
    b.arm("f", {"0": 1})  # the holder is exactly at its target: it becomes the parked thread
    assert rec.event.wait(5) and rec.parked == [("f", ParkPoint("0", 1))]
    b.abort("f")
    t.join(5)
    assert seqs == [1]


def test_hold_released_by_arm_when_not_at_target() -> None:
    b, _ = make("0")
    b.prepare("f")
    seqs: list[int] = []
    t = threading.Thread(target=lambda: seqs.append(b.enter("0")))
    t.start()
    b.arm("f", {"0": 5})
    t.join(5)
    assert seqs == [1] and b.state is State.ARMED


def test_expired_hold_goes_idle() -> None:
    b, _ = make("0")
    b.prepare("f")
    assert not b.expire_hold("other")
    assert b.expire_hold("f") and b.state is State.IDLE
    assert b.enter("0") == 1


def test_target_already_passed_is_an_error_and_disarms() -> None:
    b, _ = make("0")
    issue(b, "0", 4)
    with pytest.raises(BarrierError, match="already passed"):
        b.arm("f", {"0": 3})
    assert b.state is State.IDLE


def test_targets_for_groups_this_rank_lacks_are_ignored() -> None:
    b, _ = make("0")
    b.arm("f", {"0": 1, "7": 1})
    assert b.state is State.ARMED


def test_other_groups_may_run_below_target_while_armed() -> None:
    b, rec = make("0", "1")
    b.arm("f", {"0": 1, "1": 5})
    assert b.enter("1") == 1
    assert rec.parked == []


def test_everything_waits_once_parked() -> None:
    b, rec = make("0", "1")
    b.arm("f", {"0": 1, "1": 5})
    parker = threading.Thread(target=b.enter, args=("0",))
    parker.start()
    assert rec.event.wait(5)
    other = threading.Thread(target=b.enter, args=("1",))
    other.start()
    other.join(0.2)
    assert other.is_alive()  # nothing may start after the rank said it is quiesced
    b.abort("f")
    parker.join(5)
    other.join(5)


def test_suspend_requires_parked_and_abort_refused_after_suspend() -> None:
    b, _ = make()
    with pytest.raises(BarrierError, match="not parked"):
        b.suspend("f")
    b.arm("f", {})
    b.suspend("f")
    with pytest.raises(BarrierError, match="resume instead"):
        b.abort("f")
    with pytest.raises(BarrierError):
        b.prepare("g")
    b.release("f")
    assert b.state is State.IDLE


def test_destroyed_group_wakes_its_waiter_with_an_error() -> None:
    b, _ = make("0")
    b.prepare("f")
    errors: list[Exception] = []

    def run() -> None:
        try:
            b.enter("0")
        except BarrierError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(0.1)
    b.remove_group("0")
    b.abort("f")
    t.join(5)
    assert errors and "destroyed" in str(errors[0])


def test_freeze_refused_while_a_group_is_being_set_up() -> None:
    b, _ = make()
    with b.setup():
        with pytest.raises(BarrierError, match="setting up a process group"):
            b.prepare("f")
        assert b.state is State.IDLE
    b.prepare("f")  # once the setup is over the freeze may start
    assert b.state is State.HOLDING


def test_setup_waits_while_a_freeze_holds_and_goes_on_after_it() -> None:
    b, _ = make("0")
    b.prepare("f")
    entered = threading.Event()

    def set_up() -> None:
        with b.setup():
            entered.set()

    t = threading.Thread(target=set_up)
    t.start()
    assert not entered.wait(0.2)  # held: no store use while a freeze is under way
    b.abort("f")
    assert entered.wait(5)
    t.join(5)


def test_not_quiesced_until_a_setup_started_while_armed_ends() -> None:
    b, rec = make()
    b.arm("f", {})  # no group yet: would park at once...
    assert rec.parked == [("f", None)]
    b2, rec2 = make()
    gate = b2.setup()
    gate.__enter__()
    b2.arm("f", {})
    assert rec2.parked == []  # ...but not in the middle of creating one
    gate.__exit__(None, None, None)
    assert rec2.parked == [("f", None)]
