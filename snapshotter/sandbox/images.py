"""Reading facts out of CRIU image directories (through pycriu's image decoder).

Used before a restore to prepare what the restored tree expects to find on this machine.
Never modifies images.
"""

from __future__ import annotations

import os
import quopri
from pathlib import Path
from typing import Any


def _entries(images_dir: Path, name: str) -> list[dict[str, Any]]:
    from pycriu import images  # imported late: only agents need pycriu

    path = images_dir / name
    if not path.exists():
        return []
    with open(path, "rb") as f:
        loaded: dict[str, Any] = images.load(f)
    entries: list[dict[str, Any]] = loaded.get("entries", [])
    return entries


def bound_unix_paths(images_dir: Path) -> list[str]:
    """Filesystem paths the dumped tree's unix sockets are bound to (abstract names skipped).

    pycriu renders socket names quoted-printable, NUL terminator included.
    """
    paths = []
    for e in _entries(images_dir, "files.img"):
        usk = e.get("usk")
        if e.get("type") != "UNIXSK" or not usk or not usk.get("name"):
            continue
        raw = quopri.decodestring(usk["name"].encode()).rstrip(b"\0")
        if raw.startswith(b"/"):
            paths.append(os.fsdecode(raw))
    return sorted(set(paths))


def ensure_socket_dirs(images_dir: Path) -> list[str]:
    """Create the missing parent directories of bound unix sockets, so CRIU can bind them.

    Why: Python's multiprocessing (DataLoader workers share tensors through it) binds
    listeners under a private temporary directory that its owner removes at exit; a thaw on
    another node, or after the original job ended, finds no such directory and CRIU's bind
    fails with ENOENT. Returns the directories created.
    """
    made = []
    for p in bound_unix_paths(images_dir):
        parent = Path(p).parent
        if not parent.exists():
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            made.append(str(parent))
    return made
