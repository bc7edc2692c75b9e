"""What a writer knows is already stored: the dedup index of one snapshot being written.

Seeded with the job's previous snapshot(s) and grown with every chunk this writer stores or
finds, it answers, per chunk, in order of cost:

1. fast: a chunk whose xxh3-128 and size equal a known chunk's is that chunk (no sha256, no
   compression, no request). xxh3 is not collision-resistant: a job could craft a page pair
   that collides and so restore the other page of its own memory. It can harm only itself:
   the index holds only chunks of the job's own snapshots and of this writer.
2. known key: the chunk's sha256 names a key this writer stored or saw already.
3. the store: a HEAD on the key (another rank, node or job stored the same content).

`claim` makes concurrent workers of one writer upload one content once: the first claims it,
the others wait for its outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from snapshotter.storage import format as fmt


class DedupIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fast: dict[tuple[str, int], fmt.ChunkInfo] = {}
        self._sizes: dict[str, int] = {}  # content key -> stored size
        self._uploading: dict[str, threading.Event] = {}

    def seed(self, streams: Iterable[fmt.StreamInfo]) -> int:
        """Add every content-addressed chunk of `streams`; return how many."""
        n = 0
        with self._lock:
            for s in streams:
                for c in s.chunks:
                    if c.content_addressed:
                        self._fast[(c.xxh3, c.raw_size)] = c
                        self._sizes[c.key] = c.stored_size
                        n += 1
        return n

    def fast(self, xxh3: str, raw_size: int) -> fmt.ChunkInfo | None:
        with self._lock:
            return self._fast.get((xxh3, raw_size))

    def stored_size(self, key: str) -> int | None:
        with self._lock:
            return self._sizes.get(key)

    def claim(self, key: str) -> bool:
        """True: the caller uploads `key` and must call `settle`. False: it is stored, or was
        being uploaded by another worker, which has now settled it (check `stored_size`)."""
        while True:
            with self._lock:
                if key in self._sizes:
                    return False
                event = self._uploading.get(key)
                if event is None:
                    self._uploading[key] = threading.Event()
                    return True
            event.wait()
            # Settled: stored (loop returns False) or failed (loop lets this one try).

    def settle(self, info: fmt.ChunkInfo | None, key: str) -> None:
        """The claimed upload of `key` ended: stored as `info`, or failed (None)."""
        with self._lock:
            if info is not None:
                self.add_locked(info)
            event = self._uploading.pop(key, None)
        if event is not None:
            event.set()

    def add(self, info: fmt.ChunkInfo) -> None:
        with self._lock:
            self.add_locked(info)

    def add_locked(self, info: fmt.ChunkInfo) -> None:
        self._fast[(info.xxh3, info.raw_size)] = info
        self._sizes[info.key] = info.stored_size
