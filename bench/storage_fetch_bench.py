"""Benchmark: the fetch phase of a thaw, staged raw (the old path) vs staged compressed.

Writes one snapshot of `--ranks` CRIU-like image directories (~`--size-mib` raw in all: page
files alternating random and zero 1 MiB blocks, `--random-fraction` of them random, plus a few
small files) with SnapshotWriter into a LocalDirStore in a temp dir, then times, interleaved
over `--rounds` rounds, medians reported:

  raw staging       verify_and_fetch(decompress=True) + extract_directory per stream in turn:
                    the old node-agent path (raw `<stream>.stream` copy, then untar)
  zst staging       verify_and_fetch(decompress=False) + extract_directory per stream in turn
  zst parallel      verify_and_fetch(decompress=False) + extract_directories: the new path

Everything lives in the page cache of this machine, so this measures CPU and copy work, not
the disk; ratios within one run are what matter.

Usage: python bench/storage_fetch_bench.py [--size-mib 1024] [--ranks 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapshotter.storage import LocalDirStore, SnapshotReader, SnapshotWriter  # noqa: E402

MiB = 1024 * 1024


def make_images(root: Path, size: int, random_fraction: float, seed: int) -> None:
    """One rank's image dir: CRIU-like small files plus page files of `size` bytes in all."""
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for name in ("inventory.img", "core-1.img", "mm-1.img", "pstree.img", "files.img"):
        (root / name).write_bytes(rng.randbytes(rng.randrange(100, 64 * 1024)))
    blocks = size // MiB
    per_file = max(1, blocks // 4)
    zeros = bytes(MiB)
    for f in range(-(-blocks // per_file)):
        with open(root / f"pages-{f + 1}.img", "wb") as out:
            for _ in range(min(per_file, blocks - f * per_file)):
                out.write(rng.randbytes(MiB) if rng.random() < random_fraction else zeros)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="raw size of all ranks together")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--random-fraction", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="storage-fetch-bench-") as tmp_s:
        tmp = Path(tmp_s)
        streams = [f"rank-{r}" for r in range(args.ranks)]
        for r, s in enumerate(streams):
            make_images(
                tmp / "images" / s, args.size_mib * MiB // args.ranks, args.random_fraction, r
            )
        store = LocalDirStore(tmp / "store")
        with SnapshotWriter(store, "bench-1", workers=args.workers) as w:
            for s in streams:
                w.add_directory(s, tmp / "images" / s)
            m = w.commit({})
        print(
            f"snapshot: {len(streams)} streams, {m.raw_size / MiB:.0f} MiB raw, "
            f"{m.stored_size / MiB:.0f} MiB stored ({m.raw_size / m.stored_size:.1f}x), "
            f"{os.cpu_count()} CPUs"
        )

        def run(mode: str, out: Path) -> tuple[float, float]:
            reader = SnapshotReader(store, "bench-1", workers=args.workers)
            reader.manifest()
            staging = out / "staging"
            fetch_s = timed(
                lambda: reader.verify_and_fetch(
                    staging, streams=streams, decompress=mode == "raw staging"
                )
            )
            if mode == "zst parallel":
                extract_s = timed(lambda: reader.extract_directories({s: out / s for s in streams}))
            else:
                extract_s = timed(lambda: [reader.extract_directory(s, out / s) for s in streams])
            return fetch_s, extract_s

        modes = ["raw staging", "zst staging", "zst parallel"]
        results: dict[str, list[tuple[float, float]]] = {k: [] for k in modes}
        for rnd in range(args.rounds):
            for mode in modes if rnd % 2 == 0 else modes[::-1]:
                out = tmp / "out"
                results[mode].append(run(mode, out))
                for s in streams:  # same bytes back, whichever path
                    for f in ("pages-1.img", "core-1.img"):
                        a, b = out / s / f, tmp / "images" / s / f
                        assert a.stat().st_size == b.stat().st_size, (mode, s, f)
                shutil.rmtree(out)

        base = statistics.median(f + e for f, e in results["raw staging"])
        print(f"{'path':<14} {'fetch s':>8} {'extract s':>10} {'total s':>8} {'vs raw':>7}")
        for mode, rs in results.items():
            fetch = statistics.median(f for f, _ in rs)
            extract = statistics.median(e for _, e in rs)
            total = statistics.median(f + e for f, e in rs)
            print(f"{mode:<14} {fetch:8.2f} {extract:10.2f} {total:8.2f} {base / total:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
