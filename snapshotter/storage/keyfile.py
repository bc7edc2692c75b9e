"""Secret files a coordinator keeps (signing and key-encryption keys): made once, 0600 in a
0700 directory; when two processes make one at once, the first written wins and both read it."""

from __future__ import annotations

import os
from pathlib import Path


def create_once(path: Path, data: bytes) -> bool:
    """Write `data` to `path` unless it exists; True when this call made it."""
    if path.exists():
        return False
    _private_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic, and refuses to replace: never two different keys
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def _private_dirs(d: Path) -> None:
    """`d` and every missing parent made 0700 (mkdir's mode covers only the last one)."""
    missing = []
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        try:
            m.mkdir(mode=0o700)
        except FileExistsError:
            pass
