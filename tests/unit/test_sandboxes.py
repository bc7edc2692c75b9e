"""Who removes a sandbox init's working directory (agent/sandboxes.py): the last of its users,
and only if this agent made it. A use is counted before CRIU restores into the directory, so
a rank that ends meanwhile (the original of a fork restored on its node) cannot remove it
under the restore."""

from __future__ import annotations

from pathlib import Path

from snapshotter.agent.sandboxes import Sandboxes
from snapshotter.config import Paths


def test_the_last_user_removes_a_directory_the_agent_made(tmp_path: Path) -> None:
    books = Sandboxes(Paths(tmp_path / "home"))
    d = tmp_path / "home" / "sandbox" / "job-r0"
    books.reserve(d)  # the original's launch: made here
    books.reserve(d)  # a fork restoring into the same directory while the original runs
    assert d.is_dir() and books.in_use(str(d))
    books.release(d)  # the original ends during the fork's restore
    assert d.is_dir()
    books.release(d)  # the fork ends
    assert not d.exists() and not books.in_use(str(d))


def test_a_directory_the_agent_found_is_never_removed(tmp_path: Path) -> None:
    books = Sandboxes(Paths(tmp_path / "home"))
    d = tmp_path / "elsewhere"
    d.mkdir()
    books.reserve(d)
    books.release(d)
    assert d.is_dir()


def test_a_failed_start_gives_its_reservation_back(tmp_path: Path) -> None:
    books = Sandboxes(Paths(tmp_path / "home"))
    d = tmp_path / "home" / "sandbox" / "job-r1"
    books.reserve(d)
    books.release(d)  # the spawn failed: nothing else uses it
    assert not d.exists()
