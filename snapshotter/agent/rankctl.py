"""The agent's end of one rank's control channel (two pipes; the line protocol is
snapshotter/hook/protocol.py, shared with the rank's hook).

Replies are matched by op and freeze id; stale replies of an earlier freeze are dropped. This
object never blocks the caller for longer than the timeout it is given.

Progress replies (`ask_progress`/`progress_reply`) go to a queue of their own, matched by query
number: a progress sample can neither take a freeze's reply nor be taken for one. At most one
progress query per rank is ever unanswered, so a stopped rank's command pipe cannot fill up
with queries however often it is sampled.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping

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
        self._progress: queue.Queue[Msg | None] = queue.Queue()
        self._progress_lock = threading.Lock()
        self._query = 0
        self._asked: int | None = None  # the progress query still unanswered
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
                    self._progress.put(None)
                    return
                for line in decoder.feed(data):
                    try:
                        msg = protocol.decode(line)
                    except protocol.ProtocolError:
                        continue  # not ours to act on; the matching reply will come or not
                    if msg["op"] == protocol.PROGRESS:
                        self._progress.put(msg)
                    else:
                        self._replies.put(msg)
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

    def ask_progress(self, where: bool = False) -> int:
        """Ask the rank for its progress (unless the last query is still unanswered: then that
        one stands); the query number to pass to `progress_reply`.

        Raises:
            FreezeFailed: the control channel is closed (the rank has ended).
        """
        with self._progress_lock:
            # A late answer to the last query is stale by now: drop it and ask afresh.
            while True:
                try:
                    msg = self._progress.get_nowait()
                except queue.Empty:
                    break
                if msg is None:
                    self._progress.put(None)  # keep EOF visible; the send below says closed
                    break
                if self._asked is not None and _query(msg) == self._asked:
                    self._asked = None
            if self._asked is None:
                self._query += 1
                self.send(protocol.progress(self._query, where))
                self._asked = self._query
            return self._asked

    def progress_reply(self, query: int, timeout: float) -> protocol.Progress | None:
        """The rank's answer to progress query `query`, or None if none came within `timeout`
        (or the rank closed its channel). Never raises for what the rank sent."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                # Past the deadline, an answer already here still counts.
                msg = self._progress.get(timeout=left) if left > 0 else self._progress.get_nowait()
            except queue.Empty:
                return None
            if msg is None:
                self._progress.put(None)  # keep EOF visible to later callers
                return None
            if _query(msg) != query:
                continue  # a late answer to an earlier query
            with self._progress_lock:
                if self._asked == query:
                    self._asked = None
            try:
                return protocol.progress_of(msg)
            except protocol.ProtocolError:
                return None  # answered, but with nothing a reader can use

    def progress(self, timeout: float) -> protocol.Progress | None:
        """Ask for the rank's progress and wait up to `timeout` for it (None: no answer)."""
        try:
            query = self.ask_progress()
        except errors.SnapshotterError:
            return None
        return self.progress_reply(query, timeout)

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


def progress_all(channels: Mapping[int, RankChannel], timeout: float,
                 where: bool = False) -> dict[int, protocol.Progress]:  # fmt: skip
    """Ask every rank at once (`where`: with where its threads are), then take the answers
    that came within one `timeout`, by rank; a rank whose channel is closed has none."""
    asked: dict[int, int] = {}
    for rank, ch in channels.items():
        try:
            asked[rank] = ch.ask_progress(where)
        except errors.SnapshotterError:
            pass  # its channel closed: the rank is ending
    deadline = time.monotonic() + timeout
    answers: dict[int, protocol.Progress] = {}
    for rank, query in asked.items():
        got = channels[rank].progress_reply(query, max(0.0, deadline - time.monotonic()))
        if got is not None:
            answers[rank] = got
    return answers


def _query(msg: Msg) -> int | None:
    try:
        return protocol.query_of(msg)
    except protocol.ProtocolError:
        return None
