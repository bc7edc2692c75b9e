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


def private_mountpoints(images_dir: Path) -> list[str]:
    """Mountpoints of the dumped mount namespace's own mounts (none if none was dumped).

    These are what the sandbox mounted itself (spawn's private tmpfs): CRIU restores them,
    contents included, but the directory they are mounted on must exist on this machine.
    The namespace root and the host's mounts (external, `ext_key` set) are left out.
    """
    points = []
    for img in sorted(images_dir.glob("mountpoints-*.img")):
        for e in _entries(images_dir, img.name):
            mp = e.get("mountpoint", "")
            if not e.get("ext_key") and mp not in ("", "/"):
                points.append(mp)
    return sorted(set(points))


def has_mount_ns(images_dir: Path) -> bool:
    """Whether the images hold a mount namespace (restore then needs a root)."""
    return any(images_dir.glob("mountpoints-*.img"))


def ensure_mountpoints(images_dir: Path) -> list[str]:
    """Create the missing directories private_mountpoints() names; return those created."""
    made = []
    for mp in private_mountpoints(images_dir):
        if not os.path.isdir(mp):
            os.makedirs(mp, mode=0o755, exist_ok=True)
            made.append(mp)
    return made


def ensure_socket_dirs(images_dir: Path) -> list[str]:
    """Create the missing parent directories of bound unix sockets, so CRIU can bind them.

    Why: Python's multiprocessing (DataLoader workers share tensors through it) binds
    listeners under a private temporary directory that its owner removes at exit; a thaw on
    another node, or after the original job ended, finds no such directory and CRIU's bind
    fails with ENOENT. Sockets inside the sandbox's private tmpfs are skipped (restored with
    it). Returns the directories created.
    """
    made = []
    private = [Path(mp) for mp in private_mountpoints(images_dir)]
    for p in bound_unix_paths(images_dir):
        parent = Path(p).parent
        if any(parent == mp or mp in parent.parents for mp in private):
            continue  # inside the sandbox's own tmpfs: CRIU restores the directory with it
        if not parent.exists():
            parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            made.append(str(parent))
    return made
