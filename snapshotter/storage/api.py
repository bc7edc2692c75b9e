"""The object-store boundary: the few operations snapshots need from any backend.

A backend stores opaque byte objects under '/'-separated keys relative to its configured root
(a directory, or a bucket plus prefix). Objects are small and bounded (one chunk or one
manifest), so they travel whole as `bytes`; streaming of large images happens above this layer
by splitting them into chunks. Backends are shared by many threads at once and must be safe for
that. Nothing here knows what a snapshot is.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class ObjectMissing(LookupError):
    """The key has no object. Internal to storage: callers translate it to a user-facing error
    (a missing manifest is `SnapshotNotFound`, a missing chunk is `SnapshotCorrupt`)."""

    def __init__(self, key: str, where: str) -> None:
        super().__init__(f"no object {key!r} in {where}")
        self.key = key
        self.where = where


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object as a listing sees it."""

    key: str
    size: int  # bytes
    # Last write, seconds since the epoch, by the backend's clock (the S3 server's for S3):
    # compare it with local time only with a margin far larger than clock skew.
    mtime: float


def check_key(key: str) -> str:
    """Return `key` if it is a well-formed relative key, else raise ValueError.

    Keys are non-empty '/'-separated parts, none empty, '.' or '..', none starting with '.'
    (backends may use dot-names for their own temporary files).
    """
    if not key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"malformed object key {key!r}")
    for part in key.split("/"):
        if not part or part.startswith("."):
            raise ValueError(f"malformed object key {key!r}")
    return key


class ObjectStore(abc.ABC):
    """A flat namespace of byte objects, written atomically.

    Every method may raise:
        StorageUnavailable: the backend cannot be reached or refuses us (network down, bucket
            missing, access denied, directory not writable). The message names the backend
            (see `describe`) and what to check.
        ValueError: a malformed key (see `check_key`); a programming error, not a user one.
    """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing any object there.

        Atomic: a concurrent reader sees the old object, no object, or all of `data`, never a
        part of it.

        Raises:
            StorageUnavailable: the object could not be stored.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the whole object under `key`.

        Raises:
            ObjectMissing: there is no object under `key`.
            StorageUnavailable: the backend could not be read.
        """

    @abc.abstractmethod
    def head(self, key: str) -> int | None:
        """Return the size in bytes of the object under `key`, or None if there is none.

        Raises:
            StorageUnavailable: the backend could not be asked.
        """

    @abc.abstractmethod
    def list_keys(self, prefix: str = "") -> Iterator[str]:
        """Yield every key that starts with `prefix` (a plain string prefix, as in S3), in no
        guaranteed order.

        Raises:
            StorageUnavailable: the backend could not be listed.
        """

    @abc.abstractmethod
    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Like `list_keys`, with each object's size and last-write time (for gc, which must
        tell an abandoned write from one still going on).

        An object deleted while the listing runs may or may not be yielded.

        Raises:
            StorageUnavailable: the backend could not be listed.
        """

    @abc.abstractmethod
    def list_dirs(self, prefix: str) -> Iterator[str]:
        """Yield the distinct next path parts below `prefix` (which ends with '/'), the way S3
        lists common prefixes with delimiter '/': for keys 'a/x/1' and 'a/y', `list_dirs('a/')`
        yields 'x' (and not 'y', which is an object, not a directory). No guaranteed order.
        May also yield a part whose objects were all deleted recently (some S3-compatible
        servers, e.g. SeaweedFS, keep emptied folders for a while); confirm with `list_keys`.

        Raises:
            StorageUnavailable: the backend could not be listed.
        """

    @abc.abstractmethod
    def delete_keys(self, keys: Iterable[str]) -> list[str]:
        """Delete the objects under `keys`; keys with no object are fine (already deleted).

        Returns the keys that could not be deleted (empty when all went), so a best-effort
        cleanup can report them instead of failing halfway.

        Raises:
            StorageUnavailable: the backend could not be reached at all.
        """

    @abc.abstractmethod
    def describe(self) -> str:
        """A one-line human description of where objects go, for error messages and logs
        (e.g. "local directory /var/lib/snapshotter" or "s3://bucket/prefix at http://...")."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
