"""A store seen through a key prefix: one backend, separate namespaces.

    checkpoints = PrefixedStore(store, "checkpoints/")
    checkpoints.put_bytes("chunks/ab12...", data)    # stored as checkpoints/chunks/ab12...

Application checkpoints (snapshotter.checkpoint) live beside process snapshots in the same
bucket, with their own manifests, content chunks and gc, so that neither can ever see, count or
collect the other's objects: every key this view hands out or accepts is relative to its
prefix, and listings never leave it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from snapshotter.storage.api import ObjectInfo, ObjectStore, check_key


class PrefixedStore(ObjectStore):
    """`store` with every key under `prefix` (which must end with '/')."""

    def __init__(self, store: ObjectStore, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"a store prefix must end with '/', got {prefix!r}")
        check_key(prefix.rstrip("/"))
        self.inner = store
        self.prefix = prefix

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _strip(self, key: str) -> str:
        return key[len(self.prefix):]

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(self._key(key), data)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(self._key(key))

    def head(self, key: str) -> int | None:
        return self.inner.head(self._key(key))

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        for key in self.inner.list_keys(self.prefix + prefix):
            yield self._strip(key)

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for info in self.inner.list_objects(self.prefix + prefix):
            yield ObjectInfo(self._strip(info.key), info.size, info.mtime)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        return self.inner.list_dirs(self.prefix + prefix)

    def delete_keys(self, keys: Iterable[str]) -> list[str]:
        undeleted = self.inner.delete_keys([self._key(k) for k in keys])
        return [self._strip(k) for k in undeleted]

    def describe(self) -> str:
        return f"{self.inner.describe()} under {self.prefix}"
