"""Where a stream is cut into chunks: content-defined, at page boundaries (pure; no I/O).

CRIU writes a process's memory as whole 4 KiB pages, back to back in `pages-*.img`, in the
order of its memory areas. Fixed-size chunks dedup such a stream only while every area stays
where it was: one area grown by a page shifts every later chunk, and two data-parallel
replicas, whose identical weights sit at different offsets of their images, share nothing.
So cuts are chosen by content: after each page whose fingerprint matches a pattern (about one
page in `2**mask_bits`), with a minimum and a maximum chunk size. The same pages then give the
same chunks wherever they sit, and a change disturbs only the chunks around it.

Pages are counted from an anchor: the start of the stream, moved by `mark` to where a large
file's data starts (a tar member; its header is 512-byte aligned, not page-aligned), so cuts
fall on the image's own page boundaries. Files smaller than `min_size` are not anchored: they
ride inside their neighbours' chunks instead of each becoming a tiny object.

A page's fingerprint mixes eight of its 64-bit words (numpy, for whole batches of pages):
boundaries need only be a deterministic function of content, not a strong hash; integrity is
the chunks' sha256. A page of one repeated word (zero pages, mostly) never matches, so a run of
them is cut only at `max_size`, where the run's chunks repeat and dedup to one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

PAGE = 4096
_WORDS = PAGE // 8
# Word positions sampled per page, spread over the page, and odd multipliers to mix them.
_SAMPLE = np.array([0, 67, 131, 199, 263, 331, 395, 461], dtype=np.intp)
_MIX = np.array(
    [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
     0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x94D049BB133111EB, 0xBF58476D1CE4E5B9],
    dtype=np.uint64,
)  # fmt: skip


@dataclass(frozen=True)
class ChunkingParams:
    """Sizes in bytes, multiples of PAGE. The mean chunk is about min_size + PAGE * 2**mask_bits
    (capped by max_size)."""

    # A mean of about 1.5 MiB: each chunk costs the store one or two requests (HEAD, PUT) and
    # the agent about a millisecond of CPU each; bench/chunking_bench.py on a 615 MiB image:
    # 428 chunks, a second snapshot adds 0.49 of it, against 1653 chunks and 0.42 at 128 KiB /
    # one page in 64, which made a freeze of a small job spend 3x the CPU of format 1.
    min_size: int = 512 * 1024
    max_size: int = 8 * 1024 * 1024
    mask_bits: int = 8

    def __post_init__(self) -> None:
        if not (PAGE <= self.min_size <= self.max_size) or self.max_size % PAGE or (
            self.min_size % PAGE
        ):
            raise ValueError(f"chunk sizes must be page multiples, min <= max: {self}")
        if not 0 <= self.mask_bits <= 20:
            raise ValueError(f"mask_bits out of range: {self.mask_bits}")


def page_cuts(pages: memoryview, mask_bits: int) -> np.ndarray:
    """Indices i of the whole pages in `pages` (len a multiple of PAGE) after which a chunk may
    end: those whose fingerprint's top `mask_bits` bits are all set."""
    n = len(pages) // PAGE
    if n == 0:
        return np.empty(0, dtype=np.intp)
    words = np.frombuffer(pages, dtype=np.uint64, count=n * _WORDS).reshape(n, _WORDS)
    sampled = words[:, _SAMPLE]
    with np.errstate(over="ignore"):
        fp = (sampled * _MIX).sum(axis=1, dtype=np.uint64)
    uniform = (sampled == sampled[:, :1]).all(axis=1)
    if mask_bits == 0:
        hit = ~uniform
    else:
        hit = ((fp >> np.uint64(64 - mask_bits)) == np.uint64((1 << mask_bits) - 1)) & ~uniform
    return np.flatnonzero(hit)


class Chunker:
    """Cuts a byte stream fed in pieces into chunks (`feed` / `finish` yield them in order).

    Holds at most one chunk (`max_size`) plus the piece being fed.
    """

    def __init__(self, params: ChunkingParams | None = None) -> None:
        self.p = params or ChunkingParams()
        self._buf = bytearray()
        self._start = 0  # stream offset of _buf[0]
        self._anchor = 0  # stream offset pages are counted from
        self._scanned = 0  # offset in _buf up to which whole pages were examined

    @property
    def position(self) -> int:
        """Stream offset of the next byte fed."""
        return self._start + len(self._buf)

    def mark(self, size: int) -> Iterator[bytearray]:
        """A file of `size` bytes starts at `position`: if it is large, end the current chunk
        here and count its pages from here."""
        if size < self.p.min_size:
            return
        if self._buf:
            yield self._take(len(self._buf))
        self._anchor = self.position

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[bytearray]:
        view = memoryview(data)
        while view:
            room = self.p.max_size - len(self._buf)
            take = min(room, len(view))
            self._buf += view[:take]
            view = view[take:]
            yield from self._cut()

    def finish(self) -> Iterator[bytearray]:
        if self._buf:
            yield self._take(len(self._buf))

    def _cut(self) -> Iterator[bytearray]:
        while True:
            # Whole pages (counted from the anchor) not yet examined.
            lead = (self._anchor - (self._start + self._scanned)) % PAGE
            first = self._scanned + lead
            n = (len(self._buf) - first) // PAGE
            if n > 0:
                cuts = page_cuts(memoryview(self._buf)[first : first + n * PAGE], self.p.mask_bits)
                ends = first + (cuts + 1) * PAGE
                ok = ends[ends >= self.p.min_size]
                if ok.size:
                    yield self._take(int(ok[0]))
                    continue
                self._scanned = first + n * PAGE
            if len(self._buf) >= self.p.max_size:
                yield self._take(self.p.max_size)
                continue
            return

    def _take(self, n: int) -> bytearray:
        out = self._buf[:n]
        del self._buf[:n]
        self._start += n
        self._scanned = 0
        return out


class FixedChunker:
    """Format 1's chunking, with Chunker's interface: every chunk `size` bytes but the last."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buf = bytearray()

    def mark(self, size: int) -> Iterator[bytearray]:
        return iter(())

    def feed(self, data: bytes | bytearray | memoryview) -> Iterator[bytearray]:
        view = memoryview(data)
        while view:
            take = min(self.size - len(self._buf), len(view))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self.size:
                out, self._buf = self._buf, bytearray()
                yield out

    def finish(self) -> Iterator[bytearray]:
        if self._buf:
            out, self._buf = self._buf, bytearray()
            yield out
