"""The rank's end of the agent's control channel, and the freeze steps it drives.

Wire format: newline-delimited JSON on two inherited pipe fds (SNAPSHOTTER_CTL_IN, commands from
the agent; SNAPSHOTTER_CTL_OUT, replies). One object per line::

    agent -> rank                                   rank -> agent
    {"op":"ping"}                                   {"op":"pong","pid":P,"rank":R}
    {"op":"prepare","freeze":ID}                    {"op":"counts","freeze":ID,
                                                     "counts":{KEY:n}}
    {"op":"park","freeze":ID,"targets":{KEY:seq}}   {"op":"parked","freeze":ID,
                                                     "at":{"group":KEY,"seq":n} | null}
    {"op":"suspend","freeze":ID}                    {"op":"suspended","freeze":ID}
    {"op":"resume","freeze":ID,
     "store":{"host":H,"port":P},"epoch":E,
     "env":{K:V}}                                   {"op":"resumed","freeze":ID}
    {"op":"abort","freeze":ID}                      {"op":"aborted","freeze":ID}
    any failure                                     {"op":"error","freeze":ID,"message":M}

`parked` is sent asynchronously, by whichever thread made the rank quiesced. After `prepare`
the rank holds every new collective until `park` or `abort` arrives (or SNAPSHOTTER_HOLD_S
seconds pass), so the counts it reported stay the maximum it can reach. Pipes survive a CRIU
dump and restore with the same fd numbers, so the reader thread simply keeps reading.

This module must never leave the rank half torn down without saying so: every step either
completes or replies `error`, and a failed `resume` leaves the rank suspended, ready for another.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Any

from snapshotter.hook.barrier import BarrierError, ParkPoint, QuiesceBarrier, State
from snapshotter.hook.sockets import Owned, tcp_sockets

DEFAULT_HOLD_S = 60.0
SOCKET_CLOSE_WAIT_S = 5.0


class Hook:
    """Owns the barrier, the group and store registries, and the control reader thread."""

    def __init__(self, fd_in: int, fd_out: int, rank: int) -> None:
        self.fd_in = fd_in
        self.fd_out = fd_out
        self.rank = rank
        self.owned = Owned()
        self.barrier = QuiesceBarrier(self._on_parked)
        self.disabled: str = ""
        self._write_lock = threading.Lock()
        self._hold_timer: threading.Timer | None = None
        self._hold_s = float(os.environ.get("SNAPSHOTTER_HOLD_S", DEFAULT_HOLD_S))
        self._thread: threading.Thread | None = None
        # Filled by install_torch(); absent when torch is missing or the hook is disabled.
        self.groups: Any = None
        self.stores: Any = None

    # ---- installation --------------------------------------------------------------------

    def install_torch(self) -> None:
        """Patch torch.distributed so every group and store it creates is resumable."""
        from snapshotter.hook.resumable import GroupRegistry, install
        from snapshotter.hook.store import StoreRegistry, wrap_rendezvous

        self.groups = GroupRegistry(self.barrier, self.owned)
        self.stores = StoreRegistry(self.owned)
        wrap_rendezvous(self.stores, self.barrier.setup)
        install(self.groups)

    def start(self) -> None:
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
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._write_lock:
            view = memoryview(data)
            while view:
                n = os.write(self.fd_out, view)
                view = view[n:]

    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.fd_in, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    self._handle_line(line)
        # The agent is gone: never leave a thread held or parked for a freeze nobody finishes.
        try:
            self.barrier.abort("")
        except BarrierError:
            pass
        if self.barrier.state is State.SUSPENDED:
            # Communicators are down and only the agent could bring them back: a rank left
            # like this would hang its job's other ranks and hold its memory forever.
            warn("the node agent is gone while this rank was suspended for a freeze; exiting")
            os._exit(75)

    def _handle_line(self, line: bytes) -> None:
        freeze = ""
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a command must be a JSON object")
            freeze = str(msg.get("freeze", ""))
            op = msg.get("op")
            handler = getattr(self, f"_op_{op}", None)
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            handler(freeze, msg)
        except Exception as e:  # every failure becomes an error reply; the reader keeps going
            self.send({"op": "error", "freeze": freeze, "message": f"{type(e).__name__}: {e}"})

    # ---- ops -----------------------------------------------------------------------------

    def _op_ping(self, freeze: str, msg: dict[str, Any]) -> None:
        self.send({"op": "pong", "pid": os.getpid(), "rank": self.rank})

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
        self.send({"op": "counts", "freeze": freeze, "counts": counts})

    def _op_park(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        self._cancel_hold()
        targets = msg.get("targets") or {}
        if not isinstance(targets, dict):
            raise ValueError("targets must be an object {group: seq}")
        self.barrier.arm(freeze, {str(k): int(v) for k, v in targets.items()})

    def _on_parked(self, freeze: str, at: ParkPoint | None) -> None:
        where = None if at is None else {"group": at.group, "seq": at.seq}
        self.send({"op": "parked", "freeze": freeze, "at": where})

    def _op_abort(self, freeze: str, msg: dict[str, Any]) -> None:
        self._cancel_hold()
        self.barrier.abort(freeze)
        self.send({"op": "aborted", "freeze": freeze})

    def _op_suspend(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        self.barrier.suspend(freeze)
        # From here on the rank is suspended whatever happens; recovery is a resume.
        self._teardown()
        left = self._wait_sockets_closed()
        if left:
            desc = ", ".join(f"fd {s.fd} {s.local}->{s.remote} {s.state}" for s in left)
            raise RuntimeError(
                f"TCP sockets still open after teardown (not opened through torch.distributed's "
                f"env:// or tcp:// rendezvous or its gloo groups?): {desc}"
            )
        self.send({"op": "suspended", "freeze": freeze})

    def _op_resume(self, freeze: str, msg: dict[str, Any]) -> None:
        self._check_enabled()
        from snapshotter.hook.barrier import State

        if self.barrier.state is not State.SUSPENDED:
            raise BarrierError(
                f"cannot resume freeze {freeze!r}: barrier is {self.barrier.state.value}"
            )
        env = msg.get("env") or {}
        store = msg.get("store") or {}
        host, port = str(store["host"]), int(store["port"])
        epoch = msg.get("epoch", 0)
        for k, v in env.items():
            os.environ[str(k)] = str(v)
        try:
            self._rebuild(host, port, epoch)
        except BaseException:
            self._teardown()  # back to a clean "suspended", so another resume can be tried
            raise
        self.barrier.release(freeze)
        self.send({"op": "resumed", "freeze": freeze})

    # ---- teardown / rebuild --------------------------------------------------------------

    def _teardown(self) -> None:
        if self.groups is not None:
            self.groups.teardown_all()
        if self.stores is not None:
            self.stores.disconnect_all()
        gc.collect()

    def _wait_sockets_closed(self) -> list[Any]:
        deadline = time.monotonic() + SOCKET_CLOSE_WAIT_S
        while True:
            left = tcp_sockets()
            if not left or time.monotonic() > deadline:
                self.owned.forget_closed()
                return left
            time.sleep(0.02)

    def _rebuild(self, host: str, port: int, epoch: Any) -> None:
        if self.stores is None or self.groups is None:
            return
        self.stores.connect_all(host, port)
        if not self.groups.groups():
            return
        if self.stores.stores:
            store = self.stores.stores[0]
        else:
            # The script brought its own store; rebuild over one of ours, closed like the rest.
            import torch.distributed as dist

            with self.owned.track():
                client = dist.TCPStore(host, port, None, False, wait_for_workers=False)
            store = self.stores.wrap(client, None)
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
    print(f"snapshotter: {msg}", file=sys.stderr, flush=True)
