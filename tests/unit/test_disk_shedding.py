"""The suite's own disk hygiene (tests/support/disk.py): what a failed test keeps."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.disk import shed_bulk


def test_shed_bulk_deletes_big_files_but_keeps_logs_and_small_ones(tmp_path: Path) -> None:
    (tmp_path / "criu-logs").mkdir()
    (tmp_path / "criu-logs" / "dump.log").write_bytes(b"x" * (2 << 20))
    (tmp_path / "pages-1.img").write_bytes(os.urandom(2 << 20))
    (tmp_path / "core-1.img").write_bytes(b"small")
    (tmp_path / "store" / "chunks").mkdir(parents=True)
    (tmp_path / "store" / "chunks" / "ab12").write_bytes(os.urandom(3 << 20))
    freed = shed_bulk(tmp_path)
    assert freed == 5 << 20
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "core-1.img",
        "criu-logs/dump.log",
    ]


def test_shed_bulk_never_follows_a_link_out_of_its_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.img").write_bytes(os.urandom(2 << 20))
    root = tmp_path / "root"
    root.mkdir()
    (root / "to-outside").symlink_to(outside)
    (root / "big-link.img").symlink_to(outside / "big.img")
    assert shed_bulk(root) == 0
    assert (outside / "big.img").stat().st_size == 2 << 20


def test_shed_bulk_of_a_missing_root_frees_nothing(tmp_path: Path) -> None:
    assert shed_bulk(tmp_path / "gone") == 0
