"""What a freeze or thaw shows while it runs (snapshotter/cli/progress.py): rich bars on a
terminal, one per node and a total, kept as a text capture (tests/fixtures/); plain lines
elsewhere; JSON lines with --json. A fake clock makes the capture exact."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from rich.console import Console

from snapshotter.cli import progress

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "progress_bars.txt"
GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _upload(view: progress.View, clock: Clock) -> None:
    """Two nodes uploading 1 GiB each, a at 0.1 GiB/s, b at half that; a speeds up late."""
    view.event({"event": "phase", "phase": "dump", "node": "a", "bytes": GIB})
    view.event({"event": "phase", "phase": "upload"})
    done_a = 0
    for i in range(1, 13):
        clock.t += 1
        done_a = min(GIB, done_a + (GIB // 10 if i < 8 else GIB // 4))
        view.event({"event": "progress", "node": "a", "raw_bytes": done_a, "total_bytes": GIB})
        view.event({"event": "progress", "node": "b", "raw_bytes": i * GIB // 20,
                    "total_bytes": GIB})  # fmt: skip
    view.event({"event": "phase", "phase": "commit"})
    view.close()


def _bars_capture() -> str:
    clock = Clock()
    console = Console(file=io.StringIO(), force_terminal=True, width=110, color_system=None,
                      record=True)  # fmt: skip
    _upload(progress.Bars(console, clock, auto=False), clock)
    return console.export_text()


def test_bars_on_a_terminal_match_the_kept_capture() -> None:
    text = _bars_capture()
    if os.environ.get("SNAPSHOTTER_UPDATE_FIXTURES") == "1":
        FIXTURE.write_text(text)
    assert text == FIXTURE.read_text(), "re-make with SNAPSHOTTER_UPDATE_FIXTURES=1 if intended"


def test_bars_show_each_node_a_total_percent_recent_rate_and_time_left() -> None:
    text = _bars_capture()
    # Each refresh redraws the bars in place (the capture has no newline between frames).
    a, b, total = text[text.rindex("upload a "):].splitlines()
    assert a.startswith("upload a") and "100%" in a and "1.0/1.0 GiB" in a and "0:00:00" in a
    assert b.startswith("upload b") and " 60%" in b and "53.7 MB/s" in b and "0:00:0" in b
    assert total.startswith("total") and " 80%" in total and "1.6/2.0 GiB" in total
    assert "[   0.0s] dump [a] (1.0 GiB of images)" in _bars_capture()


def test_plain_lines_off_a_terminal() -> None:
    out = io.StringIO()
    clock = Clock()
    _upload(progress.PlainLines(out, clock), clock)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[   0.0s] dump [a] (1.0 GiB of images)"
    assert lines[2] == "[   1.0s] upload [a] 102.4 MiB  10% of 1.0 GiB"  # no rate yet
    assert "[   2.0s] upload [a] 204.8 MiB  20% of 1.0 GiB, 102.4 MiB/s, 8s left" in lines
    # After a's speed-up the rate is the last seconds' (its average since the start: 121.6).
    assert "[   8.0s] upload [a] 972.8 MiB  95% of 1.0 GiB, 133.1 MiB/s, 0s left" in lines
    assert len([line for line in lines if "[a]" in line and "100%" in line]) == 1
    last_b = [line for line in lines if "[b]" in line][-1]
    assert "60% of 1.0 GiB, 51.2 MiB/s, 8s left" in last_b, last_b
    assert lines[-1] == "[  12.0s] commit"


def test_json_lines_carry_every_event() -> None:
    out = io.StringIO()
    clock = Clock()
    _upload(progress.view(True, out), clock)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(events) == 2 + 24 + 1 and events[2]["total_bytes"] == GIB


def test_not_a_terminal_gets_plain_lines() -> None:
    assert isinstance(progress.view(False, io.StringIO()), progress.PlainLines)


def test_recent_rate_and_eta() -> None:
    r = progress.RecentRate(window=5)
    for t in range(10):
        rate = r.add(float(t), 100.0 * t if t <= 4 else 400.0 + 1000.0 * (t - 4))
    assert rate == 1000.0  # the last five seconds only
    assert progress.eta_s(50, 100, 10) == 5
    assert progress.eta_s(100, 100, 0) == 0.0
    assert progress.eta_s(50, 0, 10) is None and progress.eta_s(50, 100, 0) is None


def test_a_stream_that_fails_closes_the_bars() -> None:
    closed = []

    class V:
        def event(self, ev: progress.Msg) -> None:
            pass

        def close(self) -> None:
            closed.append(True)

    def stream():  # type: ignore[no-untyped-def]
        yield {"event": "phase", "phase": "fetch"}
        raise RuntimeError("the rpc failed")

    try:
        progress.drive(stream(), V(), lambda ev: ev)
    except RuntimeError:
        pass
    assert closed == [True]
