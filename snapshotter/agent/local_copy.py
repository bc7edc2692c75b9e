"""The newest committed snapshot of each job, kept on the node that made it (its local copy),
so that a thaw there (a rank died, the agent restarted, a preempted job comes back) restores
without fetching from the store.

    keep   a freeze committed: its image directories move (a rename, no copy) to
           copies/<job>/<snapshot>/, the job's older copy goes, and copies are evicted,
           oldest first, while they hold more than the node's cap (`to_evict`)
    take   a thaw of a kept snapshot: every stream is checked against the committed manifest
           in parallel (storage/dirstream.matches: the same tar bytes, chunk by chunk, with
           the raw sha256 the upload recorded), then linked into the thaw's work directory.
           A copy that does not match, in any byte, is deleted and the thaw fetches instead.

The store stays the truth: a copy is used only for a snapshot whose manifest the thaw read
from the store, so a deleted or expired snapshot is never thawed from a copy. A copy is the
agent's own files under its root-only home; it survives an agent restart, not a lost disk.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snapshotter import parallel
from snapshotter.storage import dirstream
from snapshotter.storage import format as fmt
from snapshotter.storage.sealing import Seal

log = logging.getLogger(__name__)
# A restore may rewrite small image files (files.img, when a file changed size since the
# snapshot): those are copied into the thaw's directory, larger ones (the page images, which
# CRIU only reads) are hard-linked.
LINK_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Copy:
    job_id: str
    snapshot_id: str
    size: int
    made: float  # when it was kept (mtime of its directory)


def to_evict(copies: Sequence[Copy], cap_bytes: int) -> list[Copy]:
    """The copies to delete so the rest fit in `cap_bytes`, oldest first: one copy per job
    (its newest), then the oldest go until the total fits (a copy bigger than the cap
    goes too)."""
    newest: dict[str, Copy] = {}
    for c in sorted(copies, key=lambda c: c.made):
        newest[c.job_id] = c
    gone = [c for c in copies if newest[c.job_id] is not c]
    kept = sorted(newest.values(), key=lambda c: c.made)
    total = sum(c.size for c in kept)
    while kept and total > cap_bytes:
        c = kept.pop(0)
        total -= c.size
        gone.append(c)
    return sorted(gone, key=lambda c: c.made)


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _materialize(src: Path, dest: Path) -> None:
    """`dest` as a copy of `src`: large files hard-linked, small ones copied."""
    for top, dirs, names in os.walk(src):
        rel = Path(top).relative_to(src)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for d in dirs:
            (dest / rel / d).mkdir(exist_ok=True)
        for n in names:
            here, there = Path(top) / n, dest / rel / n
            if here.stat().st_size >= LINK_MIN_BYTES:
                os.link(here, there)
            else:
                shutil.copy2(here, there)


class LocalCopies:
    def __init__(self, root: Path, cap_bytes: int) -> None:
        self.root = root
        self.cap_bytes = cap_bytes
        self._lock = threading.Lock()
        if root.is_dir():
            for partial in root.glob("*/.*.partial"):
                shutil.rmtree(partial, ignore_errors=True)  # a keep cut short by a crash

    @property
    def enabled(self) -> bool:
        return self.cap_bytes > 0

    def keep(self, job_id: str, snapshot_id: str, work: Path, streams: Sequence[str]) -> bool:
        """Move the committed snapshot's image directories out of `work` into the job's copy.
        Returns whether it was kept."""
        if not self.enabled or not streams:
            return False
        try:
            fmt.validate_name(snapshot_id)
            fmt.validate_name(job_id, "job id")
        except ValueError:
            return False
        job_dir = self.root / job_id
        partial = job_dir / f".{snapshot_id}.partial"
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.root, 0o700)
            partial.mkdir()
            for s in streams:
                os.rename(work / s, partial / s)  # the same filesystem: home/work, home/copies
            with self._lock:
                os.rename(partial, job_dir / snapshot_id)
                self._evict()
        except OSError as e:
            log.warning("could not keep a local copy of snapshot %s: %s", snapshot_id, e)
            shutil.rmtree(partial, ignore_errors=True)
            return False
        return (job_dir / snapshot_id).is_dir()

    def take(self, manifest: fmt.Manifest, streams: Sequence[str], dest: Path,
             workers: int, seal: Seal | None = None) -> bool:  # fmt: skip
        """Fill `dest/<stream>` for every stream from a local copy that matches `manifest`.
        False (and `dest` untouched) when there is none or it does not match. `seal`: the
        data key of a sealed manifest, whose chunk digests are keyed."""
        if not self.enabled or (manifest.sealed is not None and seal is None):
            return False
        keyed = seal.fast if manifest.sealed is not None and seal is not None else None
        found = self._find(manifest.snapshot_id)
        if found is None or any(s not in manifest.streams for s in streams):
            return False
        if not all((found / s).is_dir() for s in streams):
            return False  # this node now holds other ranks than it dumped: theirs are fetched
        out = parallel.each(
            streams, lambda s: dirstream.matches(manifest.streams[s], found / s, keyed),
            key=lambda s: s,
            workers=workers, name="copy-check",
        )  # fmt: skip
        why = {s: str(e) for s, e in out.failures.items()}
        why.update({s: r for s, r in out.results.items() if r})
        if why:
            log.warning("local copy of snapshot %s does not match its manifest (%s): deleted, "
                        "fetching from the store", manifest.snapshot_id,
                        "; ".join(f"{s}: {w}" for s, w in sorted(why.items())))  # fmt: skip
            with self._lock:
                shutil.rmtree(found, ignore_errors=True)
            return False
        with self._lock:
            if not found.is_dir():
                return False  # replaced by a newer snapshot's copy meanwhile
            try:
                for s in streams:
                    _materialize(found / s, dest / s)
            except OSError as e:
                log.warning("could not use the local copy of snapshot %s: %s",
                            manifest.snapshot_id, e)  # fmt: skip
                for s in streams:
                    shutil.rmtree(dest / s, ignore_errors=True)
                return False
        return True

    def drop_job(self, job_id: str) -> None:
        with self._lock:
            shutil.rmtree(self.root / job_id, ignore_errors=True)

    def listed(self) -> list[Copy]:
        if not self.root.is_dir():
            return []
        out = []
        for job_dir in self.root.iterdir():
            for snap in job_dir.iterdir() if job_dir.is_dir() else []:
                if snap.name.startswith("."):
                    continue
                out.append(Copy(job_dir.name, snap.name, _tree_bytes(snap), snap.stat().st_mtime))
        return out

    def _find(self, snapshot_id: str) -> Path | None:
        try:
            fmt.validate_name(snapshot_id)
        except ValueError:
            return None
        for p in self.root.glob(f"*/{snapshot_id}"):
            if p.is_dir():
                return p
        return None

    def _evict(self) -> None:
        for c in to_evict(self.listed(), self.cap_bytes):
            shutil.rmtree(self.root / c.job_id / c.snapshot_id, ignore_errors=True)
            try:
                (self.root / c.job_id).rmdir()
            except OSError:
                pass  # it still holds the job's newest copy
