"""`snapshotter gc`: its flags and how a coordinator's gc report is rendered."""

import argparse
import json
from typing import Any

import pytest

from snapshotter.cli import gc as gc_cli


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="snapshotter")
    gc_cli.add_parser(p.add_subparsers(dest="cmd"))
    return p.parse_args(list(argv))


def test_defaults_list_only_with_an_hour_of_grace() -> None:
    a = parse("gc")
    assert (a.delete, a.min_age, a.json) == (False, 3600.0, False)
    assert (gc_cli.request(a).delete, gc_cli.request(a).min_age_s) == (False, 3600.0)


def test_flags() -> None:
    a = parse("gc", "--delete", "--min-age", "90.5", "--json")
    assert (gc_cli.request(a).delete, gc_cli.request(a).min_age_s) == (True, 90.5) and a.json


@pytest.mark.parametrize("bad", ["-1", "soon", "inf", "nan"])
def test_bad_min_age_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse("gc", "--min-age", bad)
    assert e.value.code == 2 and "non-negative number of seconds" in capsys.readouterr().err


def _orphan(sid: str, action: str, reason: str = "", **kw: Any) -> dict[str, Any]:
    return {
        "snapshot_id": sid,
        "objects": 3,
        "bytes": 3 * 1024 * 1024,
        "newest_age_s": 7300.0,
        "action": action,
        "reason": reason,
        "failed_keys": [],
        **kw,
    }


def _result(orphans: list[dict[str, Any]], delete: bool) -> dict[str, Any]:
    done = [o for o in orphans if o["action"] in ("collectable", "deleted")]
    return {
        "store": "local directory /s",
        "now": 0.0,
        "min_age_s": 3600.0,
        "delete": delete,
        "orphans": orphans,
        "summary": {
            "orphans": len(orphans),
            "objects": 3 * len(orphans),
            "bytes": 3 * 1024 * 1024 * len(orphans),
            "kept": sum(o["action"] == "kept" for o in orphans),
            "collected": len(done),
            "collected_bytes": 3 * 1024 * 1024 * len(done),
            "failed": sum(o["action"] == "failed" for o in orphans),
            "failed_keys": sum(len(o["failed_keys"]) for o in orphans),
        },
    }


def test_dry_run_table_and_summary() -> None:
    res = _result(
        [
            _orphan("j-1", "collectable", "no manifest"),
            _orphan("j-2", "kept", "being written by a freeze of this coordinator"),
        ],
        delete=False,
    )
    lines = gc_cli.render(res, as_json=False).splitlines()
    assert lines[0].split() == ["SNAPSHOT", "OBJECTS", "BYTES", "AGE", "ACTION", "WHY"]
    assert lines[1].split() == ["j-1", "3", "3.0", "MiB", "2h01m", "would", "delete"]
    assert lines[2].split()[:6] == ["j-2", "3", "3.0", "MiB", "2h01m", "kept"]
    assert lines[2].endswith("  being written by a freeze of this coordinator")
    assert lines[-1] == (
        "2 orphaned snapshot(s) in local directory /s: 6 object(s), 6.0 MiB; 1 collectable "
        "(3.0 MiB), 1 kept; run `snapshotter gc --delete` to delete them"
    )


def test_delete_summary_counts_failures() -> None:
    res = _result(
        [
            _orphan("j-1", "deleted"),
            _orphan("j-2", "failed", "1 object(s) could not be deleted", failed_keys=["k"]),
        ],
        delete=True,
    )
    out = gc_cli.render(res, as_json=False)
    rows = [ln.split() for ln in out.splitlines()[1:3]]
    assert rows[0] == ["j-1", "3", "3.0", "MiB", "2h01m", "deleted"]
    assert rows[1][:6] == ["j-2", "3", "3.0", "MiB", "2h01m", "failed"]
    assert out.splitlines()[-1].endswith(
        "1 deleted (3.0 MiB freed), 0 kept, 1 failed (1 object(s) left)"
    )


def test_nothing_to_collect() -> None:
    assert gc_cli.render(_result([], delete=True), as_json=False) == (
        "no orphaned snapshots in local directory /s"
    )


def test_json_is_the_report_itself() -> None:
    res = _result([_orphan("j-1", "collectable")], delete=False)
    assert json.loads(gc_cli.render(res, as_json=True)) == res


@pytest.mark.parametrize(
    ("s", "text"),
    [(-5, "0s"), (59.9, "59s"), (60, "1m"), (3599, "59m"), (3660, "1h01m"), (90000, "1d01h")],
)
def test_human_age(s: float, text: str) -> None:
    assert gc_cli.human_age(s) == text
