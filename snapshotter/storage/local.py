"""The embedded default backend: objects are files under a local directory.

Key 'a/b/c' is the file `<root>/a/b/c`. Writes go to a dot-named temporary file in the target
directory, are fsynced, then renamed over the target, so a reader (or a crash) never sees a
partial object. Dot-names are never listed as keys. This module must never leave a temporary
file behind on a failed write, nor delete anything outside its root.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from snapshotter.errors import StorageUnavailable
from snapshotter.storage.api import ObjectInfo, ObjectMissing, ObjectStore, check_key

_TMP_PREFIX = ".tmp-"


class LocalDirStore(ObjectStore):
    """Objects as files under `root` (created on first write if missing)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    def describe(self) -> str:
        return f"local directory {self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _unavailable(self, action: str, key: str, e: OSError) -> StorageUnavailable:
        return StorageUnavailable(
            f"cannot {action} {key!r} in {self.describe()}: {e.strerror or e}",
            f"check that {self.root} exists, is a directory on a mounted filesystem with free "
            "space, and is writable by this user",
        )

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            self._write_atomically(path, data)
        except FileNotFoundError:
            # A concurrent delete_keys may prune the parent directory between our mkdir and
            # the temp file creation; one retry recreates it.
            try:
                self._write_atomically(path, data)
            except OSError as e:
                raise self._unavailable("write", key, e) from e
        except OSError as e:
            raise self._unavailable("write", key, e) from e

    def _write_atomically(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(path.parent)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError) as e:
            raise ObjectMissing(key, self.describe()) from e
        except OSError as e:
            raise self._unavailable("read", key, e) from e

    def head(self, key: str) -> int | None:
        path = self._path(key)
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise self._unavailable("stat", key, e) from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        for key, _ in self._walk(prefix):
            yield key

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for key, path in self._walk(prefix):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted since the walk saw it
            except OSError as e:
                raise self._unavailable("stat", key, e) from e
            if stat.S_ISREG(st.st_mode):
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def _walk(self, prefix: str) -> Iterator[tuple[str, Path]]:
        """(key, path) of every object whose key starts with `prefix`."""
        # Walk only the deepest directory the prefix pins down, then filter by the rest.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        top = self.root / base if base else self.root
        if not top.is_dir():
            self._check_root()
            return
        for dirpath, dirnames, filenames in os.walk(top, onerror=self._walk_error):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                if name.startswith("."):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    yield key, Path(dirpath, name)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dirs prefix must end with '/': {prefix!r}")
        top = self.root / prefix if prefix else self.root
        try:
            entries = list(os.scandir(top))
        except (FileNotFoundError, NotADirectoryError):
            self._check_root()
            return
        except OSError as e:
            raise self._unavailable("list", prefix, e) from e
        for entry in entries:
            if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
                yield entry.name

    def delete_keys(self, keys: Iterable[str]) -> list[str]:
        failed: list[str] = []
        parents: set[Path] = set()
        for key in keys:
            path = self._path(key)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                failed.append(key)
                continue
            parents.add(path.parent)
        self._prune_empty_dirs(parents)
        return failed

    def _prune_empty_dirs(self, dirs: set[Path]) -> None:
        """Remove directories left empty by deletes, up to (not including) the root, so a
        deleted snapshot leaves no directory for `list_dirs` to find."""
        for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
            while d != self.root and self.root in d.parents:
                try:
                    d.rmdir()
                except OSError:
                    break  # not empty (or raced with a writer): leave it
                d = d.parent

    def _check_root(self) -> None:
        """An absent prefix is an empty listing, but an unusable root is an outage."""
        if self.root.exists() and not self.root.is_dir():
            e = OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            raise self._unavailable("list", "", e)

    def _walk_error(self, e: OSError) -> None:
        if isinstance(e, FileNotFoundError):
            return  # deleted while we walked
        raise self._unavailable("list", str(e.filename or ""), e) from e


def _fsync_dir(path: Path) -> None:
    """Make the rename durable; some filesystems refuse fsync on a directory, which is fine."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
