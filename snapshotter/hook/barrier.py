"""The quiesce barrier: where a rank's collectives stop so its communicators can be torn down.

Every collective a rank issues passes through `QuiesceBarrier.enter` before it is issued, which
counts it on its counter: one per group for collectives, and one per *channel* for
point-to-point ops (`channel(group, src, dst)`: rank `src`'s sends to `dst` and `dst`'s
receives from `src` on that group count on the same key, so the maximum over the ranks is how
many messages the channel must carry before both ends stop). What the op returns is handed to
`track` (a `Pending`): nothing on the op's completion path calls back into Python, so the hook
never takes the GIL on a communicator's thread nor delays the next op queued behind it.

On a freeze the agent asks for the counts of every counter (`prepare`), picks for each one
a sequence number past the maximum over the ranks, and hands it back (`arm`). The thread about
to issue that op blocks and becomes the *parker*: it settles what this rank still has in
flight (polling collectives, waiting out sends and receives, whose completion gloo reports only
to a waiter), and once nothing is in flight the rank is quiesced and `on_parked` fires once.
The agent then tears communicators down (`suspend`) and later rebuilds them (`release`), or
gives up (`abort`), which lets the parked thread go with the communicators it already had.

Between `prepare` and `arm` every thread that is about to issue an op holds, so that no rank
can run past the maximum it just reported; without the hold a rank would race through the
chosen target while the agent is still computing it. A hold that is never followed by `arm` or
`abort` is let go by `expire_hold`.

Process-group setup (rendezvous, group creation) uses the store and connects communicators, so
it is gated too (`setup`): a freeze is refused while a setup runs, a setup started during a
freeze waits until the freeze is over, and a rank is never reported quiesced mid-setup.

This module knows nothing of torch or of the control channel; it must never do I/O.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

CHANNEL_MARK = "|p2p:"
_SWEEP_AT = 64  # in-flight entries beyond which `track` sweeps out every finished one


def channel(group: str, src: int, dst: int) -> str:
    """The counter of point-to-point messages from group rank `src` to `dst` on `group`."""
    return f"{group}{CHANNEL_MARK}{src}>{dst}"


class Pending(Protocol):
    """An op this rank issued that may still be in flight."""

    def done(self) -> bool:
        """True once it finished (successfully or not); never blocks."""
        ...

    def settle(self) -> None:
        """Wait a little, or until it finished (a send or receive: until its peer matched it)."""
        ...


class State(enum.Enum):
    """Where a rank is in a freeze.

    ::

        IDLE --prepare--> HOLDING --arm--> ARMED --quiesced--> PARKED --suspend--> SUSPENDED
         ^  <--abort/expire--'              |                    |                    |
         |  <--------------abort------------'                    |                    |
         |  <--------------abort---------------------------------'                    |
         '  <--------------release (resume)-------------------------------------------'

    `arm` is also accepted from IDLE (no hold). `arm` goes straight to PARKED when the rank owns
    no process group, or when a thread already holds at its target and nothing is in flight.
    In HOLDING, PARKED and SUSPENDED every collective waits; in ARMED only the one at a target.
    """

    IDLE = "idle"
    HOLDING = "holding"
    ARMED = "armed"
    PARKED = "parked"
    SUSPENDED = "suspended"


@dataclass(frozen=True)
class ParkPoint:
    """The collective a thread stopped before: the `seq`-th issued on group `group`."""

    group: str
    seq: int


class BarrierError(Exception):
    """A request that does not fit the barrier's current state; nothing was changed."""


ParkedCallback = Callable[[str, "ParkPoint | None"], None]


class QuiesceBarrier:
    """Counts collectives per group and parks the thread that reaches an armed target.

    Thread-safe. `on_parked(freeze_id, at)` is called exactly once per armed freeze, outside the
    lock, from whichever thread made the rank quiesced (the parking thread, the thread finishing
    the last in-flight collective, or the caller of `arm`).
    """

    def __init__(self, on_parked: ParkedCallback) -> None:
        self._on_parked = on_parked
        self._cond = threading.Condition(threading.Lock())  # never re-entered
        self._state = State.IDLE
        self._issued: dict[str, int] = {}
        self._pending: deque[Pending] = deque()
        self._issued_at: dict[int, float] = {}  # id(op) -> when it was tracked
        self._parker = 0  # the thread that parked: it settles what is still in flight
        self._targets: dict[str, int] = {}
        self._freeze: str = ""
        self._parked_at: ParkPoint | None = None
        self._setups = 0

    # ---- group lifecycle -------------------------------------------------------------------

    def add_group(self, key: str) -> None:
        with self._cond:
            self._issued.setdefault(key, 0)

    def remove_group(self, key: str) -> None:
        with self._cond:
            self._issued.pop(key, None)
            for k in [k for k in self._issued if k.startswith(key + CHANNEL_MARK)]:
                del self._issued[k]
            self._cond.notify_all()

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Bracket a process-group setup; waits while a freeze holds, parks or suspends."""
        with self._cond:
            while self._state in (State.HOLDING, State.PARKED, State.SUSPENDED):
                self._cond.wait()
            self._setups += 1
        try:
            yield
        finally:
            report: tuple[str, ParkPoint | None] | None = None
            with self._cond:
                self._setups -= 1
                self._cond.notify_all()
                if self._state is State.ARMED:
                    report = self._quiesced_locked()
            if report is not None:
                self._on_parked(*report)

    # ---- the collective path ---------------------------------------------------------------

    def enter(self, key: str) -> int:
        """Block while this op may not be issued; then count it and return its seq.

        A channel key (`channel(...)`) is created by its first message; a group key must
        have been added.

        Raises:
            BarrierError: the group is unknown or was destroyed while the thread waited.
        """
        me = threading.get_ident()
        with self._cond:
            while True:
                if key not in self._issued:
                    group, mark, _ = key.partition(CHANNEL_MARK)
                    if not mark or group not in self._issued:
                        raise BarrierError(f"collective on unknown or destroyed group {key!r}")
                    self._issued[key] = 0
                seq = self._issued[key] + 1
                if not self._must_wait(key, seq):
                    break
                if self._state is State.ARMED and self._parked_at is None and (
                    self._targets.get(key) == seq
                ):
                    self._parked_at = ParkPoint(key, seq)
                    self._parker = me
                if self._state is State.ARMED and self._parker == me:
                    self._park_locked()
                    continue  # the state may have moved while the lock was let go
                self._cond.wait()
            self._issued[key] = seq
            return seq

    def track(self, op: Pending) -> None:
        """`op` was just issued (after `enter`); it is in flight until it is done."""
        with self._cond:
            pending = self._pending
            while pending and pending[0].done():
                pending.popleft()
            if len(pending) >= _SWEEP_AT:
                # Callers finish ops in any order: one left undone at the front must not
                # keep every later one (and its tensors) alive.
                self._pending = pending = deque(p for p in pending if not p.done())
            pending.append(op)
            live = {id(p) for p in pending}
            self._issued_at = {k: v for k, v in self._issued_at.items() if k in live}
            self._issued_at[id(op)] = time.monotonic()

    def in_flight(self) -> int:
        """How many issued ops are not known to be done."""
        with self._cond:
            return sum(1 for p in self._pending if not p.done())

    def oldest_in_flight_s(self) -> float:
        """Seconds the oldest op still in flight has been (0.0: none)."""
        now = time.monotonic()
        with self._cond:
            ages = [now - self._issued_at.get(id(p), now) for p in self._pending if not p.done()]
        return max(ages, default=0.0)

    def _park_locked(self) -> None:
        """The parker's turn: report quiesced, or settle one op still in flight."""
        report = self._quiesced_locked()
        if report is not None:
            self._cond.release()
            try:
                self._on_parked(*report)
            finally:
                self._cond.acquire()
            return
        op = self._unsettled_locked()
        if op is None:  # a setup is still running: it reports when it ends
            self._cond.wait(0.05)
            return
        self._cond.release()
        try:
            op.settle()
        finally:
            self._cond.acquire()

    def _unsettled_locked(self) -> Pending | None:
        pending = self._pending
        while pending and pending[0].done():
            pending.popleft()
        return pending[0] if pending else None

    def _must_wait(self, key: str, seq: int) -> bool:
        if self._state in (State.HOLDING, State.PARKED, State.SUSPENDED):
            return True
        if self._state is State.ARMED:
            return self._targets.get(key) == seq
        return False

    def _quiesced_locked(self) -> tuple[str, ParkPoint | None] | None:
        if self._setups:
            return None
        if (self._parked_at is not None or not self._issued) and self._unsettled_locked() is None:
            self._state = State.PARKED
            self._cond.notify_all()
            return (self._freeze, self._parked_at)
        return None

    # ---- the control path ------------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._cond:
            return self._state

    def counts(self) -> dict[str, int]:
        with self._cond:
            return dict(self._issued)

    def prepare(self, freeze_id: str) -> dict[str, int]:
        """Start holding every new collective and return the issued counts per group."""
        with self._cond:
            if self._state not in (State.IDLE, State.HOLDING):
                raise BarrierError(
                    f"cannot prepare freeze {freeze_id!r}: barrier is {self._state.value}"
                )
            if self._setups:
                raise BarrierError(
                    f"cannot prepare freeze {freeze_id!r}: the rank is setting up a process "
                    "group (init_process_group/new_group); retry once it runs"
                )
            self._state = State.HOLDING
            self._freeze = freeze_id
            return dict(self._issued)

    def arm(self, freeze_id: str, targets: Mapping[str, int]) -> None:
        """Park the thread that is about to issue collective `targets[g]` on group `g`.

        Raises:
            BarrierError: the barrier is not idle or holding, or this rank already issued a
                target (it reported a stale count); the barrier is back to IDLE in that case.
        """
        report: tuple[str, ParkPoint | None] | None = None
        with self._cond:
            if self._state not in (State.IDLE, State.HOLDING):
                raise BarrierError(
                    f"cannot arm freeze {freeze_id!r}: barrier is {self._state.value}"
                )
            # A channel this rank has not used yet still binds it: its first message on it
            # may be one its peer will never match.
            mine = {
                k: int(v)
                for k, v in targets.items()
                if k in self._issued or k.partition(CHANNEL_MARK)[0] in self._issued
            }
            passed = {k: v for k, v in mine.items() if self._issued.get(k, 0) >= v}
            if passed:
                self._to_idle_locked()
                detail = ", ".join(
                    f"group {k} target {v} but {self._issued[k]} already issued"
                    for k, v in sorted(passed.items())
                )
                raise BarrierError(f"freeze {freeze_id!r}: target already passed ({detail})")
            self._state = State.ARMED
            self._freeze = freeze_id
            self._targets = mine
            self._parked_at = None
            # Wake the holders: each re-checks, and one holding at exactly its target parks.
            self._cond.notify_all()
            if not self._issued:
                report = self._quiesced_locked()
        if report is not None:
            self._on_parked(*report)

    def abort(self, freeze_id: str) -> None:
        """Let every held or parked thread go; communicators are untouched.

        Raises:
            BarrierError: the communicators were already torn down (recover with `release`).
        """
        with self._cond:
            if self._state is State.SUSPENDED:
                raise BarrierError(
                    f"cannot abort freeze {freeze_id!r}: communicators are torn down; "
                    "resume instead"
                )
            self._to_idle_locked()

    def expire_hold(self, freeze_id: str) -> bool:
        """Let go of a hold that `arm` never followed; True if it was still holding."""
        with self._cond:
            if self._state is State.HOLDING and self._freeze == freeze_id:
                self._to_idle_locked()
                return True
            return False

    def suspend(self, freeze_id: str) -> None:
        """Mark the communicators as torn down (the caller tears them down right after).

        Raises:
            BarrierError: the rank is not parked.
        """
        with self._cond:
            if self._state is not State.PARKED:
                raise BarrierError(
                    f"cannot suspend freeze {freeze_id!r}: barrier is {self._state.value}, "
                    "not parked"
                )
            self._state = State.SUSPENDED

    def release(self, freeze_id: str) -> None:
        """Communicators are rebuilt: let the parked thread issue its collective.

        Raises:
            BarrierError: the rank is not suspended.
        """
        with self._cond:
            if self._state is not State.SUSPENDED:
                raise BarrierError(
                    f"cannot resume freeze {freeze_id!r}: barrier is {self._state.value}, "
                    "not suspended"
                )
            self._to_idle_locked()

    def _to_idle_locked(self) -> None:
        self._state = State.IDLE
        self._targets = {}
        self._parked_at = None
        self._parker = 0
        self._cond.notify_all()
