"""A migrating rank's images from one agent to another (snapshotter/agent/handoff.py), with
real files and real tar streams: the target's copy is byte for byte the source's, and an
altered, cut or hostile stream leaves nothing behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.agent import handoff
from snapshotter.v1 import agent_pb2

pytestmark = pytest.mark.timeout(120)


def images(root: Path) -> Path:
    """Shaped like CRIU's: a page image over several pieces, small metadata, a subdirectory."""
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes(os.urandom(2 * handoff.PIECE_BYTES + 4097))
    (root / "core-1.img").write_bytes(b"\x01" * 900)
    (root / "kept").mkdir()
    (root / "kept" / "metrics.csv").write_text("step,loss\n1,0.5\n")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_the_target_gets_every_byte_and_counts_them(tmp_path: Path) -> None:
    src = images(tmp_path / "src" / "rank-3")
    seen: list[int] = []
    size = handoff.receive(handoff.pieces(src), tmp_path / "dst" / "rank-3", seen.append)
    assert tree(tmp_path / "dst" / "rank-3") == tree(src)
    assert sum(seen) == size > 2 * handoff.PIECE_BYTES
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["rank-3"]  # no temp left


def _altered(stream: Iterator[agent_pb2.ImagePiece]) -> Iterator[agent_pb2.ImagePiece]:
    """The first data piece with one bit flipped."""
    done = False
    for p in stream:
        if p.data and not done:
            data = bytearray(p.data)
            data[len(data) // 2] ^= 1
            p = agent_pb2.ImagePiece(data=bytes(data))
            done = True
        yield p


@pytest.mark.parametrize("how", ["flipped bit", "cut short", "lost end", "wrong length"])
def test_an_altered_or_incomplete_stream_leaves_nothing(tmp_path: Path, how: str) -> None:
    src = images(tmp_path / "src" / "rank-3")
    pieces = list(handoff.pieces(src))
    assert pieces[-1].last and len(pieces) > 3
    if how == "flipped bit":
        stream = list(_altered(iter(pieces)))
    elif how == "cut short":
        stream = pieces[:2]
    elif how == "lost end":
        stream = pieces[:-1]
    else:
        stream = [*pieces[:-1], agent_pb2.ImagePiece(sha256=pieces[-1].sha256,
                                                      size=pieces[-1].size + 1, last=True)]
    with pytest.raises(errors.MigrationFailed) as e:
        handoff.receive(iter(stream), tmp_path / "dst" / "rank-3", lambda n: None)
    assert "retry the migration" in e.value.next_step
    dst = tmp_path / "dst"
    assert not dst.exists() or list(dst.iterdir()) == []


@pytest.mark.parametrize("path", ["../escape", "/etc/cron.d/x", "kept/../../x", "nodir/x"])
def test_a_hostile_or_broken_path_is_refused(tmp_path: Path, path: str) -> None:
    stream = [agent_pb2.ImagePiece(path=path, file_size=1), agent_pb2.ImagePiece(data=b"x")]
    with pytest.raises(errors.MigrationFailed, match=repr(path)):
        handoff.receive(iter(stream), tmp_path / "dst" / "rank-3", lambda n: None)
    assert list((tmp_path / "dst").iterdir()) == []
    assert not (tmp_path / "escape").exists()


def test_only_files_and_directories_are_sent(tmp_path: Path) -> None:
    src = images(tmp_path / "src" / "rank-3")
    (src / "link").symlink_to("/etc/passwd")
    with pytest.raises(errors.MigrationFailed, match="neither a file nor a directory"):
        list(handoff.pieces(src))


def test_only_the_offered_ticket_reads() -> None:
    handoff.check_ticket("t-1", "t-1", "b")
    for offered, presented in (("t-1", "t-2"), ("", ""), ("t-1", "")):
        with pytest.raises(errors.PermissionDenied, match="offers no images"):
            handoff.check_ticket(offered, presented, "b")




def test_a_node_without_room_refuses_before_anything_moves(tmp_path: Path) -> None:
    handoff.check_room(tmp_path / "work", 1 << 20, "c")
    with pytest.raises(errors.MigrationFailed, match="node c has .* GiB free") as e:
        handoff.check_room(tmp_path / "work", 1 << 60, "c")
    assert "trains on where it was" in e.value.next_step
