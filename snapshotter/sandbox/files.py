"""The regular files a dumped rank holds open, across the time between dump and restore.

CRIU records every open regular file by path, with its size and the descriptor's offset, and
refuses a restore when the size on disk is not the recorded one (only files open write-only
with O_APPEND are exempt). A job that goes on after a freeze-and-continue keeps writing its
logs, metrics and CSVs, so without more its snapshot would be unthawable a minute later.
What a restore finds, by file (README: "Files a job writes"):

  open for writing, up to KEEP_LIMIT bytes     a copy taken right after the dump travels in
      the snapshot (`keep_written_files`). A restore that continues the job puts it back
      (`prepare_restore(put_back=True)`): the file is as it was at the snapshot, so the thawed
      ranks' writes redo exactly what the lost ones did ('w', 'r+', 'a', 'a+' alike, grown,
      shrunk or replaced since).
  everything else CRIU would size-check        taken as it is now: the size check is dropped
      and the offset clamped to the current size. Larger files open for writing, files open
      read-only (a data set that grew), and every file of a fork (a thaw while the original
      still runs, which must never rewrite its original's files: put_back=False).

Mapped executables and libraries keep CRIU's checks: restoring code against another binary
is never right. Files inside the sandbox's own tmpfs are dumped with it and left alone.
This module reads and rewrites image files only (through pycriu) and the files named in them.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from snapshotter.errors import SnapshotCorrupt

KEEP_LIMIT = 64 << 20  # per file
KEEP_TOTAL = 256 << 20  # per rank
KEPT_DIR = "snapshotter-files"
KEPT_INDEX = "snapshotter-files.json"
_SKIP_PREFIXES = ("/proc/", "/sys/", "/dev/")
_WRITE = os.O_WRONLY | os.O_RDWR


@dataclass(frozen=True)
class KeptFile:
    path: str
    size: int
    mode: int
    copy: str  # relative to the images directory


def _load(path: Path) -> dict[str, Any]:
    from pycriu import images  # agents only: the job's interpreter never imports this

    with open(path, "rb") as f:
        data: dict[str, Any] = images.load(f)
    return data


def _dump(data: dict[str, Any], path: Path) -> None:
    from pycriu import images

    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        images.dump(data, f)
    os.replace(tmp, path)


def _fd_file_ids(images_dir: Path) -> set[int]:
    """Ids of the files some task holds through a descriptor (not only through a mapping)."""
    ids: set[int] = set()
    for img in images_dir.glob("fdinfo-*.img"):
        for e in _load(img).get("entries", []):
            if e.get("type") == "REG":
                ids.add(int(e["id"]))
    return ids


def _files_img(images_dir: Path) -> dict[str, Any] | None:
    files = images_dir / "files.img"
    return _load(files) if files.exists() else None


def _candidates(
    images_dir: Path, files: dict[str, Any], private: Iterable[str]
) -> list[dict[str, Any]]:
    """The entries of `files` (files.img, loaded) that are regular files held by a descriptor,
    outside the sandbox's tmpfs; the same dicts, so editing one edits `files`."""
    held = _fd_file_ids(images_dir)
    out = []
    for e in files.get("entries", []):
        reg = e.get("reg")
        if e.get("type") != "REG" or reg is None or int(e["id"]) not in held:
            continue
        name = str(reg.get("name", ""))
        if not stat.S_ISREG(int(reg.get("mode", 0))) or name.startswith(_SKIP_PREFIXES):
            continue
        if any(name == p or name.startswith(p.rstrip("/") + "/") for p in private):
            continue
        out.append(e)
    return out


def keep_written_files(
    images_dir: Path,
    private: Iterable[str] = (),
    limit: int = KEEP_LIMIT,
    total: int = KEEP_TOTAL,
) -> list[KeptFile]:
    """Right after a dump (the ranks still held): copy the small files they hold open for
    writing into the images, as long as CRIU recorded them. Returns what was kept."""
    kept: list[KeptFile] = []
    used = 0
    files = _files_img(images_dir)
    for e in _candidates(images_dir, files, private) if files is not None else []:
        reg = e["reg"]
        if not int(reg.get("flags", 0)) & _WRITE:
            continue
        try:
            # CRIU records no size for write-only O_APPEND files (it never checks them);
            # the ranks are still held, so the size now is the snapshot's.
            size = int(reg["size"]) if reg.get("size") is not None else os.stat(reg["name"]).st_size
        except OSError:
            continue
        if size > limit or used + size > total:
            continue
        rel = f"{KEPT_DIR}/{len(kept)}"
        dest = images_dir / rel
        dest.parent.mkdir(exist_ok=True)
        try:
            with open(reg["name"], "rb") as src, open(dest, "wb") as out:
                # The first `size` bytes: what CRIU recorded, whatever was appended since.
                out.write(src.read(size))
        except OSError:
            dest.unlink(missing_ok=True)
            continue  # gone already: the restore takes it as it is then
        if dest.stat().st_size != size:  # shrunk meanwhile: no consistent copy to keep
            dest.unlink()
            continue
        used += size
        kept.append(KeptFile(path=reg["name"], size=size, mode=int(reg["mode"]), copy=rel))
    if kept:
        (images_dir / KEPT_INDEX).write_text(json.dumps([asdict(k) for k in kept]))
    return kept


def kept_files(images_dir: Path) -> list[KeptFile]:
    index = images_dir / KEPT_INDEX
    if not index.exists():
        return []
    try:
        return [KeptFile(**d) for d in json.loads(index.read_text())]
    except (ValueError, TypeError) as e:
        raise SnapshotCorrupt(
            f"{index} is unreadable: {e}", "thaw an older snapshot of the job"
        ) from e


def prepare_restore(
    images_dir: Path, put_back: bool, private: Iterable[str] = ()
) -> dict[str, list[str]]:
    """Before a restore: put kept copies back (`put_back`), then let CRIU take every other
    file it would size-check as it is now. Returns the paths by what was done to them."""
    done: dict[str, list[str]] = {"put_back": [], "as_is": []}
    restored: set[str] = set()
    if put_back:
        for k in kept_files(images_dir):
            _put_back(images_dir / k.copy, Path(k.path), k.mode)
            restored.add(k.path)
            done["put_back"].append(k.path)
    data = _files_img(images_dir)
    if data is None:
        return done
    changed = False
    for e in _candidates(images_dir, data, private):
        reg = e["reg"]
        if reg.get("size") is None or reg["name"] in restored:
            continue
        try:
            now = os.stat(reg["name"]).st_size
        except OSError:
            continue  # missing: CRIU says so, by name
        if now != int(reg["size"]):
            del reg["size"]
            reg["pos"] = min(int(reg.get("pos", 0)), now)
            changed = True
            done["as_is"].append(reg["name"])
    if changed:
        _dump(data, images_dir / "files.img")
    return done


def _put_back(copy: Path, path: Path, mode: int) -> None:
    """Replace `path` with the kept copy (a new file, renamed into place: a reader of the old
    one keeps what it had)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.snapshotter-restore")
    shutil.copyfile(copy, tmp)
    os.chmod(tmp, stat.S_IMODE(mode))
    os.replace(tmp, path)
