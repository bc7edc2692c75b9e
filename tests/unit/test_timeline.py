"""Where a freeze's time went: the text timeline and the Chrome trace drawn from its spans, and
`snapshotter show --timeline/--trace` on a snapshot with and without them."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from snapshotter.cli import main as cli
from snapshotter.cli.timeline import chrome_trace, timeline_text
from snapshotter.coordinator import snapshots
from snapshotter.rpc import convert
from snapshotter.storage import LocalDirStore, SnapshotWriter, signing
from snapshotter.storage import format as fmt
from snapshotter.storage.commit import commit_snapshot
from snapshotter.v1 import coordinator_pb2

pb = coordinator_pb2


def span(node: str, phase: str, start: float, end: float, rank: int = -1) -> pb.Span:
    return pb.Span(node=node, rank=rank, phase=phase, start=start, end=end)


TINY = [
    span("n0", "prepare", 100.0, 101.0),
    span("n0", "park", 101.0, 102.0),
    span("n0", "dump", 102.0, 105.0),
    span("n0", "dump", 102.5, 104.5, rank=0),
    span("n0", "upload", 105.0, 109.0),
    span("", "commit", 109.0, 110.0),
]


def test_a_tiny_freeze_draws_exactly() -> None:
    assert timeline_text(TINY, 34) == (
        "freeze timeline: 10.0s in all, one column is 0.500s\n"
        "             0s             10.0s\n"
        "coordinator |                  CC|\n"
        "n0          |PPKKDDDDDDUUUUUUUU  |\n"
        "  rank 0    |     DDDD           |\n"
        "P prepare 1.000s   K park 1.000s\n"
        "D dump 3.000s   U upload 4.000s\n"
        "C commit 1.000s\n"
    )


def two_nodes() -> list[pb.Span]:
    t = 1_700_000_000.0
    out = [span("", "commit", t + 9.0, t + 9.4)]
    for i, node in enumerate(("n1", "n0")):  # rows come in node order, not span order
        out += [
            span(node, "prepare", t, t + 0.001),  # far under a column: still drawn
            span(node, "park", t + 0.1, t + 1.0),
            span(node, "suspend", t + 1.0, t + 1.2),
            span(node, "dump", t + 1.2, t + 3.0),
            span(node, "resume", t + 3.0, t + 3.5),
            span(node, "upload", t + 3.5, t + 8.0 + i),
        ]
        out += [span(node, "dump", t + 1.3, t + 2.9, rank=2 * i + r) for r in (0, 1)]
    return out


def test_rows_are_the_coordinator_then_each_node_and_its_ranks_each_the_full_width() -> None:
    lines = timeline_text(two_nodes(), 100).splitlines()
    labels = [ln.split("|")[0].rstrip() for ln in lines if "|" in ln]
    assert labels == ["coordinator", "n0", "  rank 2", "  rank 3", "n1", "  rank 0", "  rank 1"]
    assert all(len(ln) == 100 for ln in lines if "|" in ln)
    n0 = next(ln for ln in lines if ln.startswith("n0 "))
    assert n0.split("|")[1][0] == "P"  # a 1 ms prepare takes its one column
    for phase in ("P prepare", "K park", "S suspend", "D dump", "R resume", "U upload", "C commit"):
        assert phase in timeline_text(two_nodes(), 100)
    assert all(len(ln) <= 100 for ln in lines)


def test_a_phase_of_a_newer_writer_gets_a_letter_of_its_own() -> None:
    text = timeline_text([*TINY, span("n0", "verify", 109.0, 109.5)], 60)
    assert "V verify 0.500s" in text


def test_nothing_to_draw_is_an_error_not_an_empty_chart() -> None:
    with pytest.raises(ValueError, match="no spans"):
        timeline_text([], 100)
    with pytest.raises(ValueError, match="columns"):
        timeline_text(TINY, 20)


def test_the_chrome_trace_is_valid_and_names_every_process_and_thread() -> None:
    spans = [*two_nodes(), span("n0", "upload", 50.0, 49.0)]  # end before start: a skewed clock
    trace = json.loads(json.dumps(chrome_trace(spans)))
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}  # fmt: skip
    assert all(e["ph"] in ("X", "M") for e in events)
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(spans)
    for e in xs:
        assert e["ts"] >= 0 and e["dur"] >= 0, e
        assert e["pid"] in procs and (e["pid"], e["tid"]) in threads, e
    assert sorted(procs.values()) == ["coordinator", "node n0", "node n1"]
    dumps = {threads[e["pid"], e["tid"]]: e for e in xs if e["name"] == "dump" and e["tid"]}
    assert sorted(dumps) == [f"rank {r}" for r in range(4)]
    assert dumps["rank 0"]["args"]["rank"] == 0 and dumps["rank 0"]["tid"] == 1
    first = min(xs, key=lambda e: e["ts"])
    assert first["ts"] == 0 and first["name"] == "upload"  # the earliest start is the origin


def test_the_trace_of_the_tiny_freeze_in_microseconds() -> None:
    xs = [e for e in chrome_trace(TINY)["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in xs] == [
        ("prepare", 0.0, 1e6, 0),
        ("park", 1e6, 1e6, 0),
        ("dump", 2e6, 3e6, 0),
        ("dump", 2.5e6, 2e6, 1),
        ("upload", 5e6, 4e6, 0),
        ("commit", 9e6, 1e6, 0),
    ]


# --------------------------------------------------------------------------- the manifest
def test_spans_are_signed_with_the_manifest_and_older_manifests_show_none(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    signer, ring = signing.load(tmp_path / "keys")
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "core-1.img").write_bytes(b"x" * 5000)
    streams = {}
    for sid in ("new-1", "old-1"):
        w = SnapshotWriter(store, sid)
        streams[sid] = {"rank-0": w.add_directory("rank-0", tmp_path / "img").to_dict()}
        w.release()
    stamped: list[str] = []

    def stamp() -> dict[str, Any]:
        stamped.append("called")  # after every chunk was checked, before the write
        return {"spans": [convert.plain(s) for s in TINY]}

    meta = {"source_job": "j", "stats": {"dump_s": 3.0}}
    commit_snapshot(store, "new-1", streams["new-1"], meta, signer=signer, stamp=stamp)
    commit_snapshot(store, "old-1", streams["old-1"], meta, signer=signer)
    assert stamped == ["called"]
    for sid in ("new-1", "old-1"):
        body = store.get_bytes(fmt.manifest_key(sid))
        assert ring.verify(sid, body, store.get_bytes(fmt.signature_key(sid))) == signer.key_id
    assert json.loads(store.get_bytes(fmt.manifest_key("new-1")))["meta"]["spans"][0] == {
        "node": "n0", "rank": -1, "phase": "prepare", "start": 100.0, "end": 101.0,
    }  # fmt: skip
    shown = snapshots.show(store, "new-1").summary.stats
    assert list(shown.spans) == TINY and shown.dump_s == 3.0
    assert not snapshots.show(store, "old-1").summary.stats.spans
    # A listing leaves them to `show`.
    assert not any(s.stats.spans for s in snapshots.list_snapshots(store, "j").snapshots)


# --------------------------------------------------------------------------- the CLI
def _show(monkeypatch: pytest.MonkeyPatch, spans: list[pb.Span]) -> None:
    detail = pb.SnapshotDetail(summary=pb.SnapshotSummary(snapshot_id="s1", ranks=1))
    detail.summary.stats.spans.extend(spans)

    def show(req: Any, timeout: float) -> pb.SnapshotDetail:
        assert req.snapshot_id == "s1"
        return detail

    client = SimpleNamespace(stub=SimpleNamespace(ShowSnapshot=show))
    monkeypatch.setattr(cli, "_client", lambda: client)


def test_show_timeline_and_trace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _show(monkeypatch, TINY)
    out = tmp_path / "f.json"
    assert cli.main(["show", "s1", "--timeline", "--trace", str(out)]) == 0
    got = capsys.readouterr()
    assert got.out == timeline_text(TINY, 100)
    assert str(out) in got.err
    assert json.loads(out.read_text()) == json.loads(json.dumps(chrome_trace(TINY)))
    # Without either, the description leaves the spans to --json.
    assert cli.main(["show", "s1"]) == 0
    assert "spans" not in capsys.readouterr().out
    assert cli.main(["show", "s1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["stats"]["spans"]) == len(TINY)


@pytest.mark.parametrize("flag", [["--timeline"], ["--trace", "t.json"]])
def test_a_snapshot_without_spans_says_why_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    _show(monkeypatch, [])
    assert cli.main(["show", "s1", *flag]) == 2
    err = capsys.readouterr().err
    assert "has no timeline" in err and "next step: freeze the job again" in err
    assert "Traceback" not in err


def test_timeline_and_json_together_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _show(monkeypatch, TINY)
    assert cli.main(["show", "s1", "--timeline", "--json"]) == 2
