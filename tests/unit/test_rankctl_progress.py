"""Progress queries on the agent's end of a control channel (RankChannel) and the /proc facts a
sample reports, over real pipes and a made-up /proc tree; the rank's end is played here."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter.agent.rankctl import RankChannel
from snapshotter.hook import protocol
from snapshotter.procutil import first_child, proc_state

pytestmark = pytest.mark.timeout(10)


class RankEnd:
    """The rank's ends of both pipes: reads the commands the agent sent, writes replies."""

    def __init__(self, cmd_r: int, rep_w: int) -> None:
        self.cmd_r, self.rep_w = cmd_r, rep_w
        self.decoder = protocol.LineDecoder()
        os.set_blocking(cmd_r, False)

    def commands(self) -> list[protocol.Msg]:
        try:
            data = os.read(self.cmd_r, 65536)
        except BlockingIOError:
            return []
        return [protocol.decode(line) for line in self.decoder.feed(data)]

    def reply(self, msg: protocol.Msg) -> None:
        os.write(self.rep_w, protocol.encode(msg))

    def close(self) -> None:
        fds, self.cmd_r, self.rep_w = (self.cmd_r, self.rep_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@pytest.fixture()
def pair() -> Iterator[tuple[RankChannel, RankEnd]]:
    cmd_r, cmd_w = os.pipe()
    rep_r, rep_w = os.pipe()
    ch, rank = RankChannel(1, cmd_w, rep_r), RankEnd(cmd_r, rep_w)
    yield ch, rank
    rank.close()
    ch.close()


def report(q: int, steps: int = 5) -> protocol.Msg:
    return protocol.progress_report(q, steps, {"0": 2 * steps})


def test_a_progress_answer_is_matched_by_its_query(pair: tuple[RankChannel, RankEnd]) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    (cmd,) = rank.commands()
    assert cmd == protocol.progress(q)
    rank.reply(report(q))
    assert ch.progress_reply(q, 5) == protocol.Progress(q, 5, {"0": 10})


def test_progress_and_freeze_replies_never_take_each_other(
    pair: tuple[RankChannel, RankEnd],
) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    rank.reply(protocol.counts("f1", {"0": 3}))  # a freeze's reply, arriving first
    rank.reply(report(q))
    assert ch.progress_reply(q, 5) == protocol.Progress(q, 5, {"0": 10})
    assert ch.expect("counts", "f1", 5)["counts"] == {"0": 3}
    # And a progress answer in between does not disturb a freeze waiting for its reply.
    q2 = ch.ask_progress()
    rank.reply(report(q2))
    rank.reply(protocol.done(protocol.ABORT, "f1"))
    assert ch.expect("aborted", "f1", 5)["freeze"] == "f1"
    assert ch.progress_reply(q2, 5) is not None


def test_an_unanswered_query_is_asked_only_once(pair: tuple[RankChannel, RankEnd]) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    assert ch.progress_reply(q, 0.05) is None  # a stopped rank
    assert ch.ask_progress() == q and ch.ask_progress() == q
    assert rank.commands() == [protocol.progress(q)]  # one query in the pipe, not three
    rank.reply(report(q, steps=7))
    assert ch.progress_reply(q, 5) == protocol.Progress(q, 7, {"0": 14})
    q2 = ch.ask_progress()
    assert q2 != q and rank.commands() == [protocol.progress(q2)]


def test_a_late_answer_is_dropped_for_a_fresh_query(pair: tuple[RankChannel, RankEnd]) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    assert ch.progress_reply(q, 0.05) is None
    rank.reply(report(q, steps=1))  # the rank continued, and answered the old query
    rank.reply(protocol.pong(1, 1))
    ch.expect("pong", None, 5)  # the reader is past the late answer once this one came
    q2 = ch.ask_progress()
    assert q2 != q  # the late answer is stale: a new query goes out
    rank.reply(report(q2, steps=9))
    assert ch.progress_reply(q2, 5) == protocol.Progress(q2, 9, {"0": 18})


def test_an_answer_already_here_counts_past_the_deadline(
    pair: tuple[RankChannel, RankEnd],
) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    rank.reply(report(q))
    rank.reply(protocol.pong(1, 1))
    ch.expect("pong", None, 5)  # the reader is past the answer once this one came
    assert ch.progress_reply(q, 0) == protocol.Progress(q, 5, {"0": 10})


def test_a_closed_channel_answers_nothing(pair: tuple[RankChannel, RankEnd]) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    rank.close()  # the rank exited
    assert ch.progress_reply(q, 5) is None
    assert ch.progress_reply(q, 5) is None  # EOF stays visible
    ch.close()
    assert ch.progress(0.05) is None  # nothing to send to: no answer, no raise


def test_a_malformed_answer_is_no_answer(pair: tuple[RankChannel, RankEnd]) -> None:
    ch, rank = pair
    q = ch.ask_progress()
    rank.reply({"op": "progress", "query": q, "steps": "?"})
    assert ch.progress_reply(q, 5) is None


# ---- /proc -----------------------------------------------------------------------------------


def fake_proc(root: Path, pid: int, comm: str, state: str, children: list[int]) -> None:
    task = root / str(pid) / "task" / str(pid)
    task.mkdir(parents=True)
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1\n")
    (task / "children").write_text("".join(f"{c} " for c in children))


def test_proc_state_reads_the_letter_after_the_name(tmp_path: Path) -> None:
    fake_proc(tmp_path, 10, "python) S (x", "T", [])  # a name that looks like more fields
    fake_proc(tmp_path, 11, "snapinit", "Z", [])
    assert proc_state(10, tmp_path) == "T"
    assert proc_state(11, tmp_path) == "Z"
    assert proc_state(12, tmp_path) == ""  # gone
    assert proc_state(os.getpid()) in ("R", "S")  # the real /proc


def test_first_child_is_the_oldest(tmp_path: Path) -> None:
    fake_proc(tmp_path, 20, "snapinit", "S", [21, 35])
    fake_proc(tmp_path, 30, "snapinit", "S", [])
    assert first_child(20, tmp_path) == 21
    assert first_child(30, tmp_path) is None
    assert first_child(40, tmp_path) is None


def test_a_query_for_where_the_threads_are_carries_their_lines_back(
    pair: tuple[RankChannel, RankEnd],
) -> None:
    ch, rank = pair
    q = ch.ask_progress(where=True)
    (cmd,) = rank.commands()
    assert cmd == {"op": "progress", "query": q, "where": True}
    rank.reply(protocol.progress_report(q, 5, {"0": 10}, "armed",
                                        where=["MainThread: train.py:9 main"]))  # fmt: skip
    seen = ch.progress_reply(q, 5)
    assert seen is not None and seen.where == ("MainThread: train.py:9 main",)
    assert seen.state == "armed"
