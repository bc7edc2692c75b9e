"""Benchmark: how chunking choices dedup real CRIU images, fixed-size against content-defined.

A data-parallel job (bench/state_job.py, 2 ranks, through the embedded daemon in a temporary
home) is frozen twice, --gap seconds apart; each time the node's local copy of the images is
kept. Every chunking below then cuts rank 0's and rank 1's page images of both snapshots, and
reports, per chunking:

  chunks          rank 0's image, snapshot 1
  2nd/1st         bytes of snapshot 2's rank 0 in chunks snapshot 1's rank 0 lacks, / its size
  replica/one     bytes of rank 1's image (snapshot 1) in chunks rank 0's lacks, / its size
  pages           the same two ratios counted in single pages: the floor any chunking can reach

Usage: python bench/chunking_bench.py [--gap 5] [--frozen-mb 64] [--trainable-mb 8] [--json F]
Needs root and CRIU (deploy/install.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshotter.storage.chunking import (  # noqa: E402
    PAGE,
    Chunker,
    ChunkingParams,
    FixedChunker,
)
from tests.support.cli import SnapCli  # noqa: E402

JOB = ROOT / "bench" / "state_job.py"
KiB, MiB = 1024, 1024 * 1024
CHOICES: list[tuple[str, Callable[[], Chunker | FixedChunker]]] = [
    ("fixed 8 MiB (format 1)", lambda: FixedChunker(8 * MiB)),
    ("fixed 1 MiB", lambda: FixedChunker(MiB)),
    ("fixed 64 KiB", lambda: FixedChunker(64 * KiB)),
] + [
    (f"content, min {mn // KiB} KiB, 1 page in {2**m}" + (" (default)" if (mn, m) == (
        ChunkingParams.min_size, ChunkingParams.mask_bits) else ""),
     lambda mn=mn, m=m: Chunker(ChunkingParams(min_size=mn, mask_bits=m)))
    for mn, m in [(1024 * KiB, 8), (512 * KiB, 8), (256 * KiB, 8), (256 * KiB, 7),
                  (128 * KiB, 7), (128 * KiB, 6), (64 * KiB, 6), (16 * KiB, 4)]
]  # fmt: skip


def _hashes(pieces: Iterable[bytes | bytearray]) -> dict[bytes, int]:
    return {hashlib.sha256(p).digest(): len(p) for p in pieces}


def _cut(make: Callable[[], Chunker | FixedChunker], data: bytes) -> dict[bytes, int]:
    c = make()
    return _hashes([*c.feed(data), *c.finish()])


def _new(of: dict[bytes, int], base: dict[bytes, int], size: int) -> float:
    return sum(n for h, n in of.items() if h not in base) / size


def freeze_twice(home: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    cli = SnapCli(home)
    job = cli.run("run", "--detach", "--nproc-per-node", "2", str(JOB), "--frozen-mb",
                  str(a.frozen_mb), "--trainable-mb", str(a.trainable_mb)).stdout.split()[-1]
    try:
        cli.wait_step(job, 3, timeout=600)
        kept = []
        for i in range(2):
            if i:
                time.sleep(a.gap)
            cli.json("freeze", job)
            dest = home.parent / f"images-{i}"
            shutil.copytree(home / "copies", dest)
            kept.append(dest)
        return kept[0], kept[1]
    finally:
        cli.run("cancel", job, check=False)
        cli.run("down", "--force", check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gap", type=float, default=5.0)
    ap.add_argument("--frozen-mb", type=int, default=64)
    ap.add_argument("--trainable-mb", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="snapshotter-chunking-bench-") as tmp:
        one, two = freeze_twice(Path(tmp) / "home", a)

        def image(root: Path, rank: int) -> bytes:
            files = sorted(root.glob(f"*/*/rank-{rank}/pages-*.img"),
                           key=lambda p: p.stat().st_size)  # fmt: skip
            return files[-1].read_bytes()  # the rank's process (the other: its sandbox's init)

        r0, r1, r0_later = image(one, 0), image(one, 1), image(two, 0)
    pages = [_hashes(x[i : i + PAGE] for i in range(0, len(x), PAGE)) for x in (r0, r1, r0_later)]
    rows = [{"chunking": "single pages (the floor)", "chunks": len(r0) // PAGE,
             "second_vs_first": _new(pages[2], pages[0], len(r0_later)),
             "replica_vs_one": _new(pages[1], pages[0], len(r1))}]  # fmt: skip
    for name, make in CHOICES:
        c0, c1, c2 = _cut(make, r0), _cut(make, r1), _cut(make, r0_later)
        rows.append({"chunking": name, "chunks": len(c0),
                     "second_vs_first": _new(c2, c0, len(r0_later)),
                     "replica_vs_one": _new(c1, c0, len(r1))})  # fmt: skip
    print(f"rank 0's page image: {len(r0) / MiB:.0f} MiB; snapshots {a.gap:.0f}s apart")
    print(f"{'chunking':44} {'chunks':>7} {'2nd/1st':>8} {'replica/one':>12}")
    for r in rows:
        print(f"{r['chunking']:44} {r['chunks']:7} {r['second_vs_first']:8.3f} "
              f"{r['replica_vs_one']:12.3f}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                      "image_bytes": len(r0), "rows": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
