"""Files a rank writes, across a snapshot it outlives (snapshotter/sandbox/files.py): real
CRIU, a real rank writing 'w', 'r+', 'a' and 'a+' files that grow, shrink and are replaced
between the dump and the restore."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from snapshotter.sandbox import criu, files
from tests.functional import test_sandbox_criu as criu_tests
from tests.functional import test_sandbox_spawn as base
from tests.functional.test_sandbox_spawn import Lines, Sandboxes

subreaper = base.subreaper
sandboxes = base.sandboxes
need_criu = criu_tests.need_criu

# One numbered line per tick into each file, through the mode the file is named after; the
# counter lives in the process, so a restored copy goes on from the snapshot's count.
WRITER_SRC = r"""
import os, sys, time
d = sys.argv[1]
open(os.path.join(d, "rplus.txt"), "w").close()
fs = {m: open(os.path.join(d, n), m) for m, n in
      (("w", "w.txt"), ("r+", "rplus.txt"), ("a", "a.txt"), ("a+", "aplus.txt"))}
n = 0
while True:
    n += 1
    for f in fs.values():
        f.write(f"line {n}\n"); f.flush()
    os.write(1, f"tick {n}\n".encode())
    time.sleep(0.02)
"""
NAMES = ("w.txt", "rplus.txt", "a.txt", "aplus.txt")


def _numbers(path: Path) -> list[int]:
    return [int(x) for x in re.findall(r"^line (\d+)$", path.read_text(), re.M)]


def _mutate(d: Path) -> None:
    """What can happen to a job's files after its snapshot, besides growing: one shrinks, one
    is replaced by another file at the same path."""
    with open(d / "rplus.txt", "r+") as f:
        f.truncate(8)
    (d / "other").write_text("someone else's file\n")
    os.replace(d / "other", d / "aplus.txt")


@pytest.mark.timeout(120)
def test_a_continuing_restore_finds_the_files_as_they_were_at_the_snapshot(
    sandboxes: Sandboxes, tmp_path: Path
) -> None:
    prog, d = tmp_path / "writer.py", tmp_path / "data"
    prog.write_text(WRITER_SRC)
    d.mkdir()
    sb = sandboxes.spawn(prog, str(d))
    out = Lines(sb.io.stdout)
    criu_tests.wait_ticks(out, 5)
    got: dict[str, list[files.KeptFile]] = {}
    criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log",
              while_stopped=lambda img: got.setdefault("kept", files.keep_written_files(img)))
    kept = got["kept"]
    assert sorted(Path(k.path).name for k in kept) == sorted(NAMES)
    at_snapshot = {Path(k.path).name: k.size for k in kept}
    criu_tests.wait_ticks(out, 10)  # the job goes on writing after its snapshot ...
    _mutate(d)
    sb.kill()  # ... and then dies
    sb.wait(10)
    done = files.prepare_restore(tmp_path / "img", put_back=True)
    assert sorted(Path(p).name for p in done["put_back"]) == sorted(NAMES)
    for name in NAMES:
        assert (d / name).stat().st_size == at_snapshot[name]
    copy = sandboxes.add(criu.restore(tmp_path / "img", sb.io.inodes, log_dir=tmp_path / "rl"))
    cout = Lines(copy.io.stdout)
    last = criu_tests.wait_ticks(cout, 10)
    copy.kill()
    copy.wait(10)
    # Every file reads as if the job had never stopped: 1, 2, ... with no gap, no repeat.
    for name in NAMES:
        got = _numbers(d / name)
        assert got == list(range(1, len(got) + 1)) and got[-1] >= last - 1, (name, got[-5:])


@pytest.mark.timeout(120)
def test_a_fork_takes_the_files_as_they_are_now(sandboxes: Sandboxes, tmp_path: Path) -> None:
    prog, d = tmp_path / "writer.py", tmp_path / "data"
    prog.write_text(WRITER_SRC)
    d.mkdir()
    sb = sandboxes.spawn(prog, str(d))
    out = Lines(sb.io.stdout)
    criu_tests.wait_ticks(out, 5)
    criu.dump(sb.pid, tmp_path / "img", leave_running=True, log_dir=tmp_path / "log",
              while_stopped=files.keep_written_files)
    criu_tests.wait_ticks(out, 10)
    _mutate(d)
    sb.kill()
    sb.wait(10)
    grown = (d / "w.txt").read_text()
    done = files.prepare_restore(tmp_path / "img", put_back=False)
    assert done["put_back"] == []
    assert {"w.txt", "rplus.txt"} <= {Path(p).name for p in done["as_is"]}
    copy = sandboxes.add(criu.restore(tmp_path / "img", sb.io.inodes, log_dir=tmp_path / "rl"))
    criu_tests.wait_ticks(Lines(copy.io.stdout), 5)
    copy.kill()
    copy.wait(10)
    # Nothing was rewritten: the restored writer goes on from its own offset in each file.
    assert (d / "w.txt").read_text().startswith(grown[: len(grown) // 2])
    assert (d / "rplus.txt").read_text()[:8] == "line 1\nl"  # shrunk to 8: offset clamped to it
    assert (d / "aplus.txt").read_text().startswith("someone else's file\n")  # appended to
