"""The agent's end of one rank's control channel (two pipes; the line protocol is
snapshotter/hook/protocol.py, shared with the rank's hook).

Replies are matched by op and freeze id; stale replies of an earlier freeze are dropped. This
object never blocks the caller for longer than the timeout it is given.
"""

from __future__ import annotations

import os
import queue
import threading
import time

from snapshotter import errors
from snapshotter.hook import protocol
from snapshotter.hook.protocol import Msg


class RankChannel:
    """Owns both fds it is given: the reader thread closes `from_rank_fd` at EOF (nothing else
    may: closing an fd another thread reads lets the number be reused under it), `close()`
    closes `to_rank_fd` and waits for the reader."""

    def __init__(self, rank: int, to_rank_fd: int, from_rank_fd: int) -> None:
        self.rank = rank
        self._out = to_rank_fd
        self._in = from_rank_fd
        self._replies: queue.Queue[Msg | None] = queue.Queue()
        self._send_lock = threading.Lock()
        self._closed = False
        self._reader = threading.Thread(target=self._read_loop, name=f"rankctl-{rank}", daemon=True)
        self._reader.start()

    def _read_loop(self) -> None:
        decoder = protocol.LineDecoder()
        try:
            while True:
                try:
                    data = os.read(self._in, 65536)
                except OSError:
                    data = b""
                if not data:
                    self._replies.put(None)
                    return
                for line in decoder.feed(data):
                    try:
                        self._replies.put(protocol.decode(line))
                    except protocol.ProtocolError:
                        continue  # not ours to act on; the matching reply will come or not
        finally:
            os.close(self._in)

    def send(self, msg: Msg) -> None:
        data = protocol.encode(msg)
        with self._send_lock:
            if self._closed:
                raise errors.FreezeFailed(
                    f"rank {self.rank} control channel is closed (the rank has ended)",
                    "see `snapshotter logs` for why the rank ended",
                )
            try:
                os.write(self._out, data)
            except OSError as e:
                raise errors.FreezeFailed(
                    f"rank {self.rank} control channel is closed ({e.strerror})",
                    "the rank has probably exited; see `snapshotter logs`",
                ) from e

    def expect(self, op: str, freeze: str | None, timeout: float) -> Msg:
        """Wait for reply `op` of this freeze; raise on an error reply, EOF or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise errors.QuiesceTimeout(
                    f"rank {self.rank} did not answer {op!r} within {timeout:.0f}s",
                    "the rank may be hung or in a long phase without collectives; "
                    "the job was left running; retry the freeze later",
                )
            try:
                msg = self._replies.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                self._replies.put(None)  # keep EOF visible to later callers
                raise errors.FreezeFailed(
                    f"rank {self.rank} closed its control channel (it exited)",
                    "see `snapshotter logs` for why the rank ended",
                )
            if freeze is not None and msg.get("freeze") not in (None, freeze):
                continue  # stale reply of an earlier operation
            if msg.get("op") == protocol.ERROR:
                raise errors.FreezeFailed(
                    f"rank {self.rank} reported: {msg.get('message', '?')}",
                    "see `snapshotter logs`; the freeze was undone",
                )
            if msg.get("op") == op:
                return msg

    def request(self, msg: Msg, timeout: float) -> Msg:
        """Send a command (built with snapshotter.hook.protocol) and wait for its reply."""
        self.send(msg)
        return self.expect(protocol.REPLY_TO[msg["op"]], msg.get("freeze"), timeout)

    def drain(self) -> None:
        """Drop replies left from an earlier operation."""
        while True:
            try:
                m = self._replies.get_nowait()
            except queue.Empty:
                return
            if m is None:
                self._replies.put(None)
                return

    def close(self, timeout: float = 5.0) -> None:
        """Close the agent's end toward the rank and wait (up to `timeout`) for the reader to
        see EOF; once the rank has exited that is immediate. A reader still blocked then (a
        process that kept the rank's end open) closes its fd itself when EOF comes."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.close(self._out)
            except OSError:
                pass
        self._reader.join(timeout)

    @property
    def reader_alive(self) -> bool:
        return self._reader.is_alive()
