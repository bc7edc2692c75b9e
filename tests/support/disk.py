"""Keep the suite's disk use bounded: a run keeps each failed test's files for a look, but
images, pages and store chunks are never what one reads, and a whole run's worth of them filled
a CI machine's disk once (SeaweedFS and CRIU then failed with ENOSPC in tests that had nothing
to do with the first failure)."""

from __future__ import annotations

import os
from pathlib import Path

BULK_BYTES = 1 << 20
READABLE = (".log", ".json", ".txt", ".out", ".err")


def shed_bulk(root: Path, over: int = BULK_BYTES) -> int:
    """Delete every regular file under `root` larger than `over` bytes, but logs and other text
    one reads; return the bytes freed. Symlinks are not followed and mount points not crossed,
    so nothing outside `root` goes."""
    freed = 0
    if not root.is_dir():
        return 0
    dev = root.stat().st_dev
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if _same_device(Path(dirpath, d), dev)]
        for name in filenames:
            if name.endswith(READABLE):
                continue
            path = Path(dirpath, name)
            try:
                st = path.lstat()
                if path.is_symlink() or not path.is_file() or st.st_size <= over:
                    continue
                path.unlink()
                freed += st.st_size
            except OSError:
                continue  # gone already, or busy: best effort
    return freed


def _same_device(path: Path, dev: int) -> bool:
    try:
        return not path.is_symlink() and path.lstat().st_dev == dev
    except OSError:
        return False
