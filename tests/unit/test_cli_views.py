"""Pure pieces of the CLI's views: rank-prefixed log lines, --tail, a node's row."""

from __future__ import annotations

import io

from snapshotter.cli.main import RankLines, _last_lines, _node_row


def test_rank_lines_prefix_whole_lines_and_keep_partial_ones_until_they_end() -> None:
    out = io.BytesIO()
    lines = RankLines(out, prefixed=True)
    lines.write(0, b"step 1\nste")
    lines.write(1, b"hello\n")
    lines.write(0, b"p 2\n")
    lines.write(1, b"no newline")
    lines.close()
    assert out.getvalue() == (
        b"[rank0]: step 1\n[rank1]: hello\n[rank0]: step 2\n[rank1]: no newline\n"
    )


def test_one_rank_is_shown_as_it_is() -> None:
    out = io.BytesIO()
    lines = RankLines(out, prefixed=False)
    lines.write(3, b"a\nb")
    lines.close()
    assert out.getvalue() == b"a\nb"


def test_tail() -> None:
    assert _last_lines(b"1\n2\n3\n", 2) == b"2\n3\n"
    assert _last_lines(b"1\n2\n3", 1) == b"3"
    assert _last_lines(b"1\n", 0) == b"" and _last_lines(b"", 5) == b""


def test_node_health() -> None:
    base = {"name": "a", "address": "10.0.0.1:7071", "live": True, "heartbeat_age_s": 0.4,
            "agent": {"running_jobs": ["j1", "j2"], "gpu_faults": [], "cpus": 16, "gpus": 8},
            "links": [{"name": "eth1", "up": True}, {"name": "eth2", "up": False}],
            "drained_links": ["eth1"]}  # fmt: skip
    assert _node_row(base) == ["a", "10.0.0.1:7071", "ok", "0.4s ago", "16", "8", "j1,j2",
                               "eth1(drained),eth2(down)"]  # fmt: skip
    assert _node_row({**base, "live": False})[2] == "LOST"
    assert _node_row({**base, "draining": True})[2] == "ok, DRAINING"
    assert _node_row({**base, "error": "deadline exceeded", "agent": {}})[2:7] == [
        "NOT ANSWERING", "0.4s ago", "-", "-", "-"]
    fault = {"kind": "xid", "code": 79, "fatal": True}
    assert _node_row({**base, "agent": {"gpu_faults": [fault]}})[2] == "GPU FAULT (xid 79)"
    assert _node_row({**base, "heartbeat_age_s": None, "links": []})[3::4] == ["-", "-"]


def test_the_audit_report_names_the_bad_interface_and_the_verdict() -> None:
    from snapshotter.cli.main import _audit_text
    from snapshotter.v1 import coordinator_pb2 as pb

    rep = pb.AuditReport(rounds=3, seconds=4.25, passed=False)
    rep.nodes.add(node="a", status="healthy")
    rep.nodes.add(node="b", status="failed", why=["storage: connection refused"])
    rep.interfaces.add(node="b", plane=1, rtt_ms=0.3, mbps=2.4, retrans=0.02,
                       status="failed", why=["throughput 2.4 MB/s is under 10% of the median"])
    rep.links.add(a="a", b="b", plane=1, rtt_ms=0.3, mbps=2.4, retrans=0.02, status="failed")
    text = _audit_text(rep)
    assert "storage: connection refused" in text and "2.00%" in text and "a->b" in text
    assert text.splitlines()[-1] == "audit FAILED: 2 node(s), 1 probe(s) in 3 round(s), 4.2 s"
