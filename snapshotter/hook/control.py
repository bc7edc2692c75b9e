"""The rank's end of the agent's control channel, and the freeze steps it drives.

The wire format (one JSON object per line on fds SNAPSHOTTER_CTL_IN / SNAPSHOTTER_CTL_OUT) is
defined in snapshotter/hook/protocol.py, shared with the agent. After `prepare` the rank
holds every new collective until `park` or `abort` arrives (or SNAPSHOTTER_HOLD_S seconds
pass), so the counts it reported stay the maximum it can reach. Pipes survive a CRIU dump and
restore with the same fd numbers, so the reader thread simply keeps reading.

This module must never leave the rank half torn down without saying so: every step either
completes or replies `error`, and a failed `resume` leaves the rank suspended, ready for another.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from typing import Any

from snapshotter.hook import protocol, stacks, telemetry
from snapshotter.hook.barrier import BarrierError, ParkPoint, QuiesceBarrier, State
from snapshotter.hook.sockets import ForeignSockets, Owned, tcp_sockets
from snapshotter.hook.telemetry import StepClock

DEFAULT_HOLD_S = 60.0
SOCKET_CLOSE_WAIT_S = 5.0


class Hook:
    """Owns the barrier, the group and rendezvous-store registries, and the control reader."""

    def __init__(self, fd_in: int, fd_out: int, rank: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self.rank = rank
        self.owned = Owned()
        self.foreign = ForeignSockets()
        self.barrier = QuiesceBarrier(self._on_parked)
        self.disabled: str = ""
        self._write_lock = threading.Lock()
        self._hold_timer: threading.Timer | None = None
        self._hold_s = float(os.environ.get("SNAPSHOTTER_HOLD_S", DEFAULT_HOLD_S))
        self._thread: threading.Thread | None = None
        # Optimizer steps taken, all optimizers together (see _count_step), and when the
        # latest finished (telemetry.py; None: the record is off).
        self.steps = 0
        self.step_clock: StepClock | None = StepClock() if telemetry.enabled() else None
        # Filled by install_torch(); absent when torch is missing or the hook is disabled.
        self.groups: Any = None
        self.rdzv: Any = None

    # ---- installation --------------------------------------------------------------------

    def install_torch(self) -> None:
        """Patch torch.distributed so every group and store it creates is resumable."""
        import torch  # native.load() looks for the torch this rank imported

        from snapshotter.hook import native
        from snapshotter.hook.rdzv import RdzvRegistry, wrap_rendezvous
        from snapshotter.hook.resumable import GroupRegistry, install

        self.barrier = self._native_barrier(native, torch.__version__) or self.barrier
        self.groups = GroupRegistry(self.barrier, self.owned)
        self.rdzv = RdzvRegistry(self.owned)
        wrap_rendezvous(self.rdzv, self.barrier.setup)
        install(self.groups)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError as e:  # a torch without global optimizer hooks: freezes still work
            warn(f"optimizer steps are not counted ({e}); progress reports 0 steps")
            return
        register_optimizer_step_post_hook(self._count_step)

    def _native_barrier(self, native: Any, torch_version: str) -> Any:
        """The native gate when it is built for this torch (no group exists yet to move)."""
        try:
            ext = native.load()
        except Exception as e:  # noqa: BLE001 - a broken build: the Python path still works
            warn(f"the hook's native path did not load ({type(e).__name__}: {e}); every "
                 "collective pays for the Python path; rebuild with deploy/install.sh")  # fmt: skip
            return None
        if ext is None:
            if os.environ.get(native.ENV_VAR, "1") != "0":
                warn(f"the hook's native path is not built for torch {torch_version}: "
                     "collectives issued from C++ (DDP, FSDP) pay for the Python path; "
                     "`python -m snapshotter.hook.native --build` builds it")  # fmt: skip
            return None
        return native.NativeBarrier(ext, self._on_parked)

    def _count_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Runs on the training thread after every optimizer.step(): one increment, no lock and
        # nothing else. Two optimizers stepping on two threads at once could lose one count;
        # a progress reader wants a trend, not an exact ledger.
        self.steps += 1
        clock = self.step_clock
        if clock is not None:
            clock.tick()

    def start(self) -> None:
        self.foreign.install()
        os.register_at_fork(after_in_child=self._after_fork_in_child)
        self._thread = threading.Thread(
            target=self._read_loop, name="snapshotter-control", daemon=True
        )
        self._thread.start()

    def _after_fork_in_child(self) -> None:
        # A forked child (a DataLoader worker) is not the rank: it must not keep copies of the
        # rank's connections or of its control channel.
        self.owned.close_in_child()
        for fd in (self.fd_in, self.fd_out):
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- wire ----------------------------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        data = protocol.encode(msg)
        with self._write_lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd_out, view)
                view = view[n:]

    def _read_loop(self) -> None:
        try:
            self._read_until_agent_gone()
        finally:
            # Whatever ended the loop, the end below must run: a reader thread that died of an
            # exception would leave a suspended rank alive forever, out of every agent's reach.
            self._agent_gone()

    def _read_until_agent_gone(self) -> None:
        decoder = protocol.LineDecoder()
        while True:
            try:
                chunk = os.read(self.fd_in, 65536)
            except OSError:
                return
            if not chunk:
                return
            for line in decoder.feed(chunk):
                try:
                    self._handle_line(line)
                except OSError:  # its reply cannot be written: nobody reads the channel
                    return

    def _agent_gone(self) -> None:
        # Never leave a thread held or parked for a freeze nobody finishes.
        try:
            self.barrier.abort("")
        except BarrierError:
            pass
        if self.barrier.state is State.SUSPENDED:
            # Communicators are down and only the agent could bring them back: a rank left
            # like this would hang its job's other ranks and hold its memory forever. (An agent
            # killed while it restored this rank took the only reader of its stderr with it:
            # the warning may go nowhere, the exit must still happen.)
            warn("the node agent is gone while this rank was suspended for a freeze; exiting")
            os._exit(75)

    def _handle_line(self, line: bytes) -> None:
        freeze = ""
        try:
            msg = protocol.decode(line)
            freeze = str(msg.get("freeze", ""))
            op = msg["op"]
            handler = getattr(self, f"_op_{op}", None) if op in protocol.REPLY_TO else None
            if handler is None:
                raise protocol.ProtocolError(f"unknown op {op!r}")
            handler(freeze, msg)
        except Exception as e:  # every failure becomes an error reply; the reader keeps going
            self.send(protocol.error(freeze, f"{type(e).__name__}: {e}"))

    # ---- ops -----------------------------------------------------------------------------

    def _op_ping(self, freeze: str, msg: dict[str, Any]) -> None:
        native = getattr(self.barrier, "ext", None) is not None
        self.send(protocol.pong(os.getpid(), self.rank, native))

    def _op_progress(self, freeze: str, msg: dict[str, Any]) -> None:
        # Answered in every barrier state and also when the hook is disabled (0 steps, no
        # groups): reading the counters changes nothing the training threads see.
        query = protocol.query_of(msg)
        where = stacks.where() if msg.get("where") else None
        self.send(protocol.progress_report(query, self.steps, self.barrier.counts(),
                                           self.barrier.state.value,
                                           self.barrier.oldest_in_flight_s(),
                                           self._telemetry(), where))  # fmt: skip

    def _telemetry(self) -> dict[str, Any] | None:
        if self.step_clock is None:
            return None
        sources = []
        native = getattr(self.barrier, "latencies", None)
        if native is not None:
            sources.append(native())
        if self.groups is not None and self.groups.latencies is not None:
            sources.append(self.groups.latencies.snapshot())
        return telemetry.summary(self.step_clock.durations(), sources)

    def _check_enabled(self) -> None:
        if self.disabled:
            raise RuntimeError(f"snapshotter hook is not active in this rank: {self.disabled}")

    def _op_prepare(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        counts = self.barrier.prepare(freeze)
        self._cancel_hold()
        timer = threading.Timer(self._hold_s, self.barrier.expire_hold, args=(freeze,))
        timer.daemon = True
        self._hold_timer = timer
        timer.start()
        self.send(protocol.counts(freeze, counts))

    def _op_park(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        self._cancel_hold()
        self.barrier.arm(freeze, protocol.targets_of(msg))

    def _on_parked(self, freeze: str, at: ParkPoint | None) -> None:
        self.send(
            protocol.parked(
                freeze, None if at is None else at.group, None if at is None else at.seq
            )
        )

    def _op_abort(self, freeze: str, msg: dict[str, Any]) -> None:
        self._cancel_hold()
        self.barrier.abort(freeze)
        self.send(protocol.done(protocol.ABORT, freeze))

    def _op_suspend(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        self.barrier.suspend(freeze)
        # From here on the rank is suspended whatever happens; recovery is a resume.
        self._teardown()
        left = self._wait_sockets_closed()
        if left:
            desc = ", ".join(f"fd {s.fd} {s.local}->{s.remote} {s.state}" for s in left)
            raise RuntimeError(
                "TCP sockets of torch.distributed or another C library still open after "
                f"teardown (not made resumable by the hook): {desc}"
            )
        self.send(protocol.done(protocol.SUSPEND, freeze))

    def _op_resume(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        from snapshotter.hook.barrier import State

        if self.barrier.state is not State.SUSPENDED:
            raise BarrierError(
                f"cannot resume freeze {freeze!r}: barrier is {self.barrier.state.value}"
            )
        host, port, epoch, env = protocol.rdzv_of(msg)
        for k, v in env.items():
            os.environ[k] = v
        try:
            self._rebuild(host, port, epoch)
        except BaseException:
            self._teardown()  # back to a clean "suspended", so another resume can be tried
            raise
        self.barrier.release(freeze)
        os.environ[protocol.RESUMED_ENV] = str(epoch)
        self.send(protocol.done(protocol.RESUME, freeze))

    # ---- teardown / rebuild --------------------------------------------------------------

    def _teardown(self) -> None:
        if self.groups is not None:
            self.groups.teardown_all()
        if self.rdzv is not None:
            self.rdzv.disconnect_all()

    def _wait_sockets_closed(self) -> list[Any]:
        """TCP sockets left after teardown that are not the job's own Python connections
        (those a snapshot keeps: a restore brings them back closed)."""
        deadline = time.monotonic() + SOCKET_CLOSE_WAIT_S
        collected = False
        while True:
            foreign = self.foreign.fds()
            left = [s for s in tcp_sockets() if s.fd not in foreign]
            if left and not collected:
                # Teardown shuts every backend down itself. A full collection costs a big
                # training process 150-200 ms while every rank stands still: it runs only when
                # a socket is still open, in case garbage in a reference cycle holds it.
                gc.collect()
                collected = True
                continue
            if not left or time.monotonic() > deadline:
                self.owned.forget_closed()
                return left
            time.sleep(0.02)

    def _rebuild(self, host: str, port: int, epoch: Any) -> None:
        if self.rdzv is None or self.groups is None:
            return
        self.rdzv.connect_all(host, port)
        if not self.groups.groups():
            return
        if self.rdzv.stores:
            store = self.rdzv.stores[0]
        else:
            # The script brought its own store; rebuild over one of ours, closed like the rest.
            import torch.distributed as dist

            with self.owned.track():
                client = dist.TCPStore(host, port, None, False, wait_for_workers=False)
            store = self.rdzv.wrap(client, None)
        self.groups.rebuild_all(store, epoch)

    def _cancel_hold(self) -> None:
        timer, self._hold_timer = self._hold_timer, None
        if timer is not None:
            timer.cancel()


def from_env() -> Hook | None:
    """The hook for this rank, or None when the launcher gave no control channel."""
    fd_in = os.environ.get("SNAPSHOTTER_CTL_IN")
    fd_out = os.environ.get("SNAPSHOTTER_CTL_OUT")
    if not fd_in or not fd_out:
        return None
    return Hook(int(fd_in), int(fd_out), int(os.environ.get("RANK", "-1")))


def warn(msg: str) -> None:
    """Say `msg` on stderr, or nothing when no one reads it any more (never raises)."""
    try:
        print(f"snapshotter: {msg}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a broken or closed stderr
        pass
