"""Content-defined chunking at page boundaries (storage/chunking.py) and the chunk codec
(storage/codec.py): pure functions over bytes."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from snapshotter.storage.chunking import PAGE, Chunker, ChunkingParams, FixedChunker
from snapshotter.storage.codec import Codec, CodecError, CodecPolicy

P = ChunkingParams(min_size=16 * PAGE, max_size=256 * PAGE, mask_bits=5)


def _chunks(data: bytes, params: ChunkingParams = P, piece: int = 100_000,
            marks: dict[int, int] | None = None) -> list[bytes]:  # fmt: skip
    c = Chunker(params)
    out: list[bytes] = []
    pos = 0
    marks = marks or {}
    cuts = sorted(set(range(0, len(data), piece)) | set(marks))
    for i, start in enumerate(cuts):
        if start in marks:
            out += c.mark(marks[start])
        end = cuts[i + 1] if i + 1 < len(cuts) else len(data)
        out += c.feed(data[start:end])
        pos = end
    assert pos == len(data)
    out += c.finish()
    return [bytes(x) for x in out]


def _random(n_pages: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n_pages * PAGE, dtype=np.uint8).tobytes()


def _shared_bytes(a: list[bytes], b: list[bytes]) -> int:
    hb = {hashlib.sha256(x).digest() for x in b}
    return sum(len(x) for x in a if hashlib.sha256(x).digest() in hb)


def test_chunks_rebuild_the_stream_within_their_bounds() -> None:
    data = _random(3000, 1) + bytes(1000 * PAGE) + b"tail"
    chunks = _chunks(data)
    assert b"".join(chunks) == data
    assert all(P.min_size <= len(x) <= P.max_size for x in chunks[:-1])
    # Cuts fall on page boundaries (counted from the start here).
    assert all(len(x) % PAGE == 0 for x in chunks[:-1])
    # How the stream is fed does not move a cut.
    assert _chunks(data, piece=7777) == chunks == _chunks(data, piece=len(data))


def test_a_shift_by_whole_pages_disturbs_only_the_chunks_around_it() -> None:
    body = _random(4000, 2)
    a = _chunks(_random(10, 3) + body)
    b = _chunks(_random(37, 4) + body)
    assert _shared_bytes(b, a) >= len(body) - 3 * P.max_size // 4
    # Fixed-size chunks share nothing after such a shift.
    fa, fb = FixedChunker(64 * PAGE), FixedChunker(64 * PAGE)
    ca = [bytes(x) for x in fa.feed(_random(10, 3) + body)] + [bytes(x) for x in fa.finish()]
    cb = [bytes(x) for x in fb.feed(_random(37, 4) + body)] + [bytes(x) for x in fb.finish()]
    assert _shared_bytes(cb, ca) == 0


def test_a_mark_anchors_pages_where_a_large_file_starts() -> None:
    body = _random(2000, 5)
    # The same file data after headers of different, non-page lengths (a tar's 512-byte
    # blocks): anchored at its first byte, its chunks are the same.
    a = _chunks(b"h" * 1536 + body, marks={1536: len(body)})
    b = _chunks(b"x" * 3584 + body, marks={3584: len(body)})
    assert _shared_bytes(a, b) >= len(body) - P.max_size
    # Small files are not anchored (no tiny chunks).
    assert len(_chunks(b"s" * 1000 + b"t" * 1000, marks={1000: 1000})) == 1


def test_uniform_pages_are_cut_only_at_the_maximum() -> None:
    chunks = _chunks(bytes(1000 * PAGE))
    assert [len(x) for x in chunks[:-1]] == [P.max_size] * (len(chunks) - 1)
    assert len(set(chunks[:-1])) == 1  # ... so they dedup to one


def test_bad_chunking_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        ChunkingParams(min_size=1000)
    with pytest.raises(ValueError):
        ChunkingParams(min_size=8 * PAGE, max_size=4 * PAGE)


@pytest.mark.parametrize("codec", ["auto", "zstd", "lz4", "none"])
def test_codecs_round_trip(codec: str) -> None:
    c = Codec(CodecPolicy(codec=codec))
    for raw in (b"", b"ckpt" * 100_000, os.urandom(300_000)):
        stored = c.encode(raw)
        assert Codec().decode(stored, len(raw)) == raw


def test_auto_stores_incompressible_chunks_raw_and_compresses_the_rest() -> None:
    c = Codec()
    noise = os.urandom(1 << 20)
    assert c.encode(noise)[3:4] == b"n" and len(c.encode(noise)) == len(noise) + 4
    text = b"step 12 loss 0.25\n" * 60_000
    assert c.encode(text)[3:4] == b"z" and len(c.encode(text)) < len(text) // 10


def test_damaged_objects_do_not_decode() -> None:
    c = Codec(CodecPolicy(codec="zstd"))
    good = c.encode(b"ckpt" * 10_000)
    for bad in (b"", b"XXXz" + good[4:], good[:4] + b"\x00" * 20, b"SNPq" + good[4:]):
        with pytest.raises(CodecError):
            Codec().decode(bad, 40_000)
    with pytest.raises(CodecError):
        Codec().decode(good, 100)  # bigger than the manifest says: refused, not allocated
    with pytest.raises(ValueError):
        CodecPolicy(codec="gzip")
