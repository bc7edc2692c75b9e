"""How one content-addressed chunk is stored: a 4-byte header naming its codec, then the bytes.

    object := "SNP" CODEC payload      CODEC: "n" raw | "z" zstd frame | "4" lz4 frame

The object names its own codec because two writers may store the same content (the same key)
with different codecs (settings differ between agents, or library versions): any of them reads
back to the same raw bytes, which the reader checks against the key's sha256.

The codec is chosen per chunk by measurement (`Codec.encode` with policy "auto"): a sample from
the middle of the chunk is compressed with zstd level 1; if it does not shrink below
`incompressible_ratio`, the chunk is stored raw (float weights and optimizer state compress by
under 10% at ~0.3 GB/s a core: not worth a core), otherwise it is compressed with the configured
codec and level, and kept raw anyway if that did not help.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import lz4.frame
import zstandard

MAGIC = b"SNP"
RAW, ZSTD, LZ4 = b"n", b"z", b"4"
HEADER = 4
CODECS = ("auto", "zstd", "lz4", "none")
_SAMPLE = 64 * 1024


class CodecError(ValueError):
    """A stored chunk that does not decode (a damaged or foreign object)."""


@dataclass(frozen=True)
class CodecPolicy:
    codec: str = "auto"  # one of CODECS
    zstd_level: int = 1
    incompressible_ratio: float = 0.9

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}: use one of {', '.join(CODECS)}")
        if not -7 <= self.zstd_level <= 19:
            raise ValueError(f"zstd level {self.zstd_level} out of range -7..19")


class Codec:
    """Encodes and decodes chunk objects. One per writer or reader; safe across threads (zstd
    contexts are kept per thread)."""

    def __init__(self, policy: CodecPolicy | None = None) -> None:
        self.policy = policy or CodecPolicy()
        self._local = threading.local()

    def encode(self, raw: bytes | bytearray) -> bytes:
        codec = self.policy.codec
        if codec == "auto":
            codec = "zstd" if self._compressible(raw) else "none"
        if codec == "zstd":
            body, tag = self._zstd(self.policy.zstd_level).compress(raw), ZSTD
        elif codec == "lz4":
            body, tag = lz4.frame.compress(raw), LZ4
        else:
            body, tag = b"", RAW
        if tag is RAW or len(body) >= len(raw):
            return MAGIC + RAW + bytes(raw)
        return MAGIC + tag + body

    def decode(self, stored: bytes, raw_size: int) -> bytes:
        """The raw bytes of `stored`, at most `raw_size` of them. Raises CodecError."""
        if len(stored) < HEADER or stored[:3] != MAGIC:
            raise CodecError("not a snapshotter chunk object (bad header)")
        tag, body = stored[3:4], memoryview(stored)[HEADER:]
        try:
            if tag == RAW:
                return bytes(body)
            if tag == ZSTD:
                # The frame header's content size decides the allocation: check it first.
                declared = zstandard.frame_content_size(body)
                if declared > raw_size:
                    raise CodecError(f"declares {declared} bytes, more than {raw_size}")
                out = self._dctx().decompress(body, max_output_size=raw_size)
                if len(out) > raw_size:
                    raise CodecError(f"decodes to {len(out)} bytes, more than {raw_size}")
                return out
            if tag == LZ4:
                declared = lz4.frame.get_frame_info(body).get("content_size", 0)
                if declared > raw_size:
                    raise CodecError(f"declares {declared} bytes, more than {raw_size}")
                out = lz4.frame.decompress(body)
                if len(out) > raw_size:
                    raise CodecError(f"decodes to {len(out)} bytes, more than {raw_size}")
                return bytes(out)
        except (zstandard.ZstdError, RuntimeError) as e:
            raise CodecError(f"does not decompress: {e}") from e
        raise CodecError(f"unknown codec {tag!r}")

    def _compressible(self, raw: bytes | bytearray) -> bool:
        if len(raw) <= _SAMPLE:
            sample = memoryview(raw)
        else:
            mid = len(raw) // 2
            sample = memoryview(raw)[mid - _SAMPLE // 2 : mid + _SAMPLE // 2]
        out = self._zstd(1).compress(sample)
        return len(out) < self.policy.incompressible_ratio * len(sample)

    def _zstd(self, level: int) -> zstandard.ZstdCompressor:
        cache: dict[int, zstandard.ZstdCompressor] | None = getattr(self._local, "c", None)
        if cache is None:
            cache = self._local.c = {}
        if level not in cache:
            cache[level] = zstandard.ZstdCompressor(level=level)
        return cache[level]

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d: zstandard.ZstdDecompressor | None = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d
