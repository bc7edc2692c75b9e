"""The node's chunk cache: shared chunks this node stored or fetched, kept on its disk.

`CachedStore` wraps the node's ObjectStore. Shared chunks (`chunks/<sha256>`) never change under
their key, so a copy here is as good as the store's: `get_bytes` reads it from disk when it is
here, and every chunk this node uploads or fetches is kept, so a thaw or a migration onto a
node that already holds the chunks fetches nothing again. Readers check every chunk against
its key whatever its source, and drop a bad copy with `evict` before fetching it again.

Everything else (manifests, format-1 chunks, `head`, listings, deletes) goes to the store:
a cached chunk says nothing about whether the store still has it. The cache holds at most
`max_bytes`; the least recently used chunks go first. Files are written to a temporary name
and renamed, so a crash leaves no partial chunk under a key.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path

from snapshotter.storage import format as fmt
from snapshotter.storage.api import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)


class CachedStore(ObjectStore):
    def __init__(self, store: ObjectStore, root: Path, max_bytes: int) -> None:
        self.store = store
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # key -> size, oldest first
        self._bytes = 0
        self._fetching: dict[str, threading.Event] = {}
        self.hits = 0
        root.mkdir(parents=True, exist_ok=True)
        found = []
        for p in root.glob("*/*"):
            if p.name.startswith("."):
                p.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            st = p.stat()
            found.append((st.st_mtime, f"{fmt.CONTENT_PREFIX}{p.parent.name}/{p.name}", st.st_size))
        for _, key, size in sorted(found):
            self._lru[key] = size
            self._bytes += size
        self._shrink()

    def describe(self) -> str:
        return self.store.describe()

    def _path(self, key: str) -> Path:
        return self.root / key[len(fmt.CONTENT_PREFIX) :]

    # -- the cached part ------------------------------------------------------------------

    def get_bytes(self, key: str) -> bytes:
        if not fmt.is_content_key(key):
            return self.store.get_bytes(key)
        while True:
            with self._lock:
                cached = key in self._lru
                if cached:
                    self._lru.move_to_end(key)
                    waiting = None
                else:
                    # One fetch per chunk at a time: data-parallel replicas on this node list
                    # the same chunks, and the second reader takes the first one's copy.
                    waiting = self._fetching.get(key)
                    if waiting is None:
                        self._fetching[key] = threading.Event()
            if cached:
                try:
                    data = self._path(key).read_bytes()
                    with self._lock:
                        self.hits += 1
                    return data
                except OSError:
                    self.evict(key)
                    continue
            if waiting is None:
                break
            waiting.wait()
        try:
            data = self.store.get_bytes(key)
            self._keep(key, data)
        finally:
            with self._lock:
                done = self._fetching.pop(key)
            done.set()
        return data

    def put_bytes(self, key: str, data: bytes) -> None:
        self.store.put_bytes(key, data)
        if fmt.is_content_key(key):
            self._keep(key, data)

    def evict(self, key: str) -> bool:
        """Drop the cached copy of `key`; True if there was one."""
        with self._lock:
            size = self._lru.pop(key, None)
            if size is not None:
                self._bytes -= size
        if size is None:
            return False
        self._path(key).unlink(missing_ok=True)
        return True

    def _keep(self, key: str, data: bytes) -> None:
        if self.max_bytes <= 0 or len(data) > self.max_bytes:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("chunk cache %s: cannot keep %s: %s", self.root, key, e)
            return
        with self._lock:
            old = self._lru.pop(key, None)
            self._bytes += len(data) - (old or 0)
            self._lru[key] = len(data)
        self._shrink()

    def _shrink(self) -> None:
        drop = []
        with self._lock:
            while self._bytes > self.max_bytes and self._lru:
                key, size = self._lru.popitem(last=False)
                self._bytes -= size
                drop.append(key)
        for key in drop:
            self._path(key).unlink(missing_ok=True)

    def delete_keys(self, keys: Iterable[str]) -> list[str]:
        keys = list(keys)
        for k in keys:
            if fmt.is_content_key(k):
                self.evict(k)
        return self.store.delete_keys(keys)

    # -- passed through -------------------------------------------------------------------

    def head(self, key: str) -> int | None:
        return self.store.head(key)

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        return self.store.list_keys(prefix)

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.store.list_objects(prefix)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        return self.store.list_dirs(prefix)
