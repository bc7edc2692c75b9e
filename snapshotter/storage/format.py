"""The on-store snapshot format: key layout, manifest, and the rules that make one valid.

Layout, as a grammar over object keys (relative to the store's root):

    store     := content* snapshot*
    content   := "chunks/" HEX2 "/" SHA     ; version 2: shared by every snapshot that has it
    snapshot  := chunk* manifest?           ; committed  <=>  manifest present
    chunk     := "snapshots/" ID "/chunks/" STREAM "/" INDEX   ; version 1 only
    manifest  := "snapshots/" ID "/manifest.json"
    ID, STREAM:= [A-Za-z0-9][A-Za-z0-9._-]{0,127}
    INDEX     := 8 decimal digits, 00000000 .. 99999999
    SHA       := 64 hex digits, the sha256 of the chunk's raw bytes; HEX2 its first two

Objects:

    content   := codec.py's object: "SNP" CODEC payload, decoding to the raw bytes whose sha256
                 is SHA (so equal content is stored once, whoever wrote it)
    chunk     := zstd-frame(raw)            ; version 1: raw = bytes [INDEX*chunk_size,
                                            ; +chunk_size) of the stream
    manifest  := UTF-8 JSON {
                   "format": "snapshotter-snapshot", "version": 1 | 2 | 3,
                   "snapshot_id": ID, "created_at": unix seconds (float),
                   "meta": {...},           ; the caller's, opaque to storage
                   "streams": { STREAM: { "raw_size": int, "chunk_size": int,
                                          "chunking": "fixed" | "content",  ; absent: fixed
                                          "chunks": [ chunk_entry* ] } },
                   "sealed": { "tenant": NAME, "key_id": 16 hex },   ; version 3 only
                   "checksum": hex sha256 of the canonical JSON of all other fields }
    chunk_entry := { "index": int, "key": chunk key, "raw_size": int, "stored_size": int,
                     "sha256": hex sha256 of the stored bytes ("" for a content key: its
                               object may be any encoding of the raw bytes),
                     "raw_sha256": hex sha256 of the raw bytes,
                     "xxh3": hex xxh3-128 of the raw bytes (content keys; "" otherwise) }

A "fixed" stream's chunks are `chunk_size` bytes each but the last; a "content" stream's are
cut by chunking.py, each 1..chunk_size bytes, the offset of one the sum of those before. A
version-1 manifest has only fixed streams of per-snapshot chunks; version 2 may mix both
kinds of chunk (a snapshot gathered from agents on both sides of an upgrade). Readers read both
versions; writers write 2 unless told 1 (a fleet with agents that read only 1).

Version 3 is a sealed (encrypted) snapshot, sealing.py: every chunk is content-addressed, its
object is sealed under the tenant's data key `key_id`, and where this grammar says sha256 of
the raw bytes (SHA, "raw_sha256") and xxh3 it means the keyed digests sealing.py defines. Older
readers refuse version 3 by its number, never by misreading it.

The manifest is written last, after every chunk is known to be stored, so a reader either
finds a complete snapshot or none. Canonical JSON is `json.dumps(sort_keys=True,
separators=(",", ":"))`. This module is pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

FORMAT_NAME = "snapshotter-snapshot"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2, 3)
SEALED_VERSION = 3
SNAPSHOTS_PREFIX = "snapshots/"
CONTENT_PREFIX = "chunks/"
FIXED, CONTENT = "fixed", "content"
MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
MAX_CHUNKS = 100_000_000
# The tenant of a job launched without one (datakeys.py: whose data keys seal its snapshots).
DEFAULT_TENANT = "default"

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")
_HEX32_RE = re.compile(r"[0-9a-f]{32}")
_HEX16_RE = re.compile(r"[0-9a-f]{16}")


class ManifestError(ValueError):
    """A manifest that does not parse or breaks a rule above. Readers report it as
    `SnapshotCorrupt`; it never reaches a user as itself."""


def validate_name(name: str, what: str = "snapshot id") -> str:
    """Return `name` if it is a safe snapshot id / stream name, else raise ValueError."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(
            f"invalid {what} {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def snapshot_prefix(snapshot_id: str) -> str:
    return f"{SNAPSHOTS_PREFIX}{validate_name(snapshot_id)}/"


def manifest_key(snapshot_id: str) -> str:
    return f"{snapshot_prefix(snapshot_id)}{MANIFEST_NAME}"


def signature_key(snapshot_id: str) -> str:
    """The manifest's signature (storage/signing.py), written just before the manifest."""
    return f"{snapshot_prefix(snapshot_id)}{SIGNATURE_NAME}"


def chunk_key(snapshot_id: str, stream: str, index: int) -> str:
    validate_name(stream, "stream name")
    if not 0 <= index < MAX_CHUNKS:
        raise ValueError(f"chunk index {index} out of range")
    return f"{snapshot_prefix(snapshot_id)}chunks/{stream}/{index:08d}"


def content_key(raw_sha256: str) -> str:
    """The key of the content-addressed chunk whose raw bytes have this sha256."""
    if not _HEX64_RE.fullmatch(raw_sha256):
        raise ValueError(f"malformed sha256 {raw_sha256!r}")
    return f"{CONTENT_PREFIX}{raw_sha256[:2]}/{raw_sha256}"


def is_content_key(key: str) -> bool:
    return key.startswith(CONTENT_PREFIX)


def chunk_count(raw_size: int, chunk_size: int) -> int:
    """How many chunks a stream of `raw_size` bytes takes (an empty stream takes none)."""
    if chunk_size <= 0 or raw_size < 0:
        raise ValueError(f"bad sizes: raw_size={raw_size} chunk_size={chunk_size}")
    return -(-raw_size // chunk_size)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ChunkInfo:
    index: int
    key: str
    raw_size: int
    stored_size: int
    sha256: str  # of the stored (compressed) bytes; "" for a content key
    raw_sha256: str
    xxh3: str = ""  # of the raw bytes; content keys only

    @property
    def content_addressed(self) -> bool:
        return is_content_key(self.key)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "index": self.index,
            "key": self.key,
            "raw_size": self.raw_size,
            "stored_size": self.stored_size,
            "sha256": self.sha256,
            "raw_sha256": self.raw_sha256,
        }
        if self.xxh3:
            d["xxh3"] = self.xxh3
        return d


@dataclass(frozen=True)
class StreamInfo:
    name: str
    raw_size: int
    chunk_size: int
    chunks: tuple[ChunkInfo, ...]
    chunking: str = FIXED

    @property
    def stored_size(self) -> int:
        return sum(c.stored_size for c in self.chunks)

    @cached_property
    def _offsets(self) -> tuple[int, ...]:
        out, at = [], 0
        for c in self.chunks:
            out.append(at)
            at += c.raw_size
        return tuple(out)

    def offset(self, index: int) -> int:
        """Byte offset of chunk `index` in the raw stream."""
        if self.chunking == FIXED:
            return index * self.chunk_size
        return self._offsets[index]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "raw_size": self.raw_size,
            "chunk_size": self.chunk_size,
            "chunks": [c.to_dict() for c in self.chunks],
        }
        if self.chunking != FIXED:
            d["chunking"] = self.chunking
        return d


@dataclass(frozen=True)
class Sealing:
    """Whose data key sealed a version-3 snapshot (sealing.py, datakeys.py)."""

    tenant: str
    key_id: str

    def to_dict(self) -> dict[str, str]:
        return {"tenant": self.tenant, "key_id": self.key_id}


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    created_at: float
    meta: Mapping[str, Any]
    streams: Mapping[str, StreamInfo] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    sealed: Sealing | None = None

    @property
    def raw_size(self) -> int:
        return sum(s.raw_size for s in self.streams.values())

    @property
    def stored_size(self) -> int:
        return sum(s.stored_size for s in self.streams.values())

    def chunks(self) -> list[tuple[StreamInfo, ChunkInfo]]:
        return [(s, c) for s in self.streams.values() for c in s.chunks]

    def content_keys(self) -> set[str]:
        """The shared (content-addressed) chunks this snapshot needs."""
        return {c.key for _, c in self.chunks() if c.content_addressed}

    def _body(self) -> dict[str, Any]:
        body = {
            "format": FORMAT_NAME,
            "version": self.version,
            "snapshot_id": self.snapshot_id,
            "created_at": self.created_at,
            "meta": dict(self.meta),
            "streams": {name: s.to_dict() for name, s in sorted(self.streams.items())},
        }
        if self.sealed is not None:
            body["sealed"] = self.sealed.to_dict()
        return body

    def to_json(self) -> bytes:
        """Serialize with a self-checksum. Raises ManifestError if `meta` is not JSON."""
        validate(self)
        body = self._body()
        try:
            canonical = _canonical(body)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest meta is not JSON-serializable: {e}") from e
        checksum = sha256_hex(canonical)
        # Compact, like the checksum's canonical form: an indented dump takes json's pure-Python
        # encoder, seconds for the manifest of a 16,384-rank job (bench/scale_bench.py). Older
        # manifests were indented; from_json reads both. "checksum" sorts before every other
        # key, so the canonical form with it is the one without it and it spliced in first:
        # the manifest is encoded once, not twice.
        assert min(body) > "checksum", sorted(body)
        return b'{"checksum":"' + checksum.encode() + b'",' + canonical[1:]

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate. Raises ManifestError on anything not exactly right."""
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise ManifestError(f"manifest is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise ManifestError("manifest is not a JSON object")
        if body.get("format") != FORMAT_NAME:
            raise ManifestError(f"not a snapshot manifest (format={body.get('format')!r})")
        if body.get("version") not in READ_VERSIONS:
            raise ManifestError(
                f"manifest version {body.get('version')!r} is not supported "
                f"(this snapshotter reads versions {', '.join(map(str, READ_VERSIONS))}; "
                "upgrade it to read newer snapshots)"
            )
        checksum = body.pop("checksum", None)
        try:
            canonical = _canonical(body)
        except ValueError as e:  # NaN or an infinity: JSON that no writer of ours makes
            raise ManifestError(f"manifest holds a value JSON does not allow: {e}") from e
        if checksum != sha256_hex(canonical):
            raise ManifestError("manifest checksum mismatch (manifest damaged or edited)")
        try:
            manifest = cls(
                snapshot_id=body["snapshot_id"],
                created_at=float(body["created_at"]),
                meta=_require(body["meta"], dict, "meta"),
                streams={
                    name: stream_from_dict(name, s)
                    for name, s in _require(body["streams"], dict, "streams").items()
                },
                version=body["version"],
                sealed=_sealing(body.get("sealed")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is malformed: {e!r}") from e
        validate(manifest)
        return manifest


def _sealing(d: Any) -> Sealing | None:
    if d is None:
        return None
    d = _require(d, dict, "sealed")
    return Sealing(tenant=_require(d["tenant"], str, "tenant"),
                   key_id=_require(d["key_id"], str, "key_id"))  # fmt: skip


def version_for(streams: Mapping[str, StreamInfo], sealed: Sealing | None = None) -> int:
    """The oldest format version that can describe these streams (old readers read it)."""
    if sealed is not None:
        return SEALED_VERSION
    if any(s.chunking != FIXED or any(c.content_addressed for c in s.chunks)
           for s in streams.values()):  # fmt: skip
        return 2
    return 1


def validate(manifest: Manifest) -> None:
    """Check the rules of the grammar above. Raises ManifestError."""
    try:
        validate_name(manifest.snapshot_id)
        if manifest.version not in READ_VERSIONS:
            raise ValueError(f"unknown format version {manifest.version!r}")
        if manifest.version < version_for(manifest.streams):
            raise ValueError("a version-1 manifest lists content-addressed chunks")
        if (manifest.sealed is not None) != (manifest.version == SEALED_VERSION):
            raise ValueError(f"version {manifest.version} with sealed={manifest.sealed}")
        if manifest.sealed is not None:
            validate_name(manifest.sealed.tenant, "tenant")
            if not _HEX16_RE.fullmatch(manifest.sealed.key_id):
                raise ValueError(f"malformed data key id {manifest.sealed.key_id!r}")
            if any(not c.content_addressed for _, c in manifest.chunks()):
                raise ValueError("a sealed manifest lists a chunk that is not content-addressed")
        for name, stream in manifest.streams.items():
            validate_name(name, "stream name")
            if name != stream.name:
                raise ValueError(f"stream {name!r} carries name {stream.name!r}")
            validate_stream(manifest.snapshot_id, stream)
    except ValueError as e:
        raise ManifestError(str(e)) from e


def validate_stream(snapshot_id: str, s: StreamInfo) -> None:
    """The rules of one stream's description. Raises ValueError."""
    if s.chunk_size <= 0 or s.raw_size < 0:
        raise ValueError(f"stream {s.name!r}: bad sizes {s.raw_size}/{s.chunk_size}")
    if s.chunking == FIXED:
        n = chunk_count(s.raw_size, s.chunk_size)
        if len(s.chunks) != n:
            raise ValueError(
                f"stream {s.name!r}: {len(s.chunks)} chunks for {s.raw_size} bytes "
                f"at chunk size {s.chunk_size} (expected {n})"
            )
    elif s.chunking == CONTENT:
        if sum(c.raw_size for c in s.chunks) != s.raw_size:
            raise ValueError(f"stream {s.name!r}: chunk sizes do not add up to {s.raw_size}")
    else:
        raise ValueError(f"stream {s.name!r}: unknown chunking {s.chunking!r}")
    for i, c in enumerate(s.chunks):
        if s.chunking == FIXED:
            good_size = c.raw_size == min(s.chunk_size, s.raw_size - s.offset(i))
        else:
            good_size = 0 < c.raw_size <= s.chunk_size
        if c.content_addressed:
            good_key = c.key == content_key(c.raw_sha256) and bool(_HEX32_RE.fullmatch(c.xxh3))
            good_key = good_key and c.sha256 == ""
        else:
            good_key = c.key == chunk_key(snapshot_id, s.name, i) and c.xxh3 == ""
            good_key = good_key and bool(_HEX64_RE.fullmatch(c.sha256))
        if c.index != i or not good_key or not good_size:
            raise ValueError(f"stream {s.name!r}: chunk entry {i} is inconsistent: {c}")
        if c.stored_size < 0:
            raise ValueError(f"stream {s.name!r}: chunk {i} has negative stored size")
        if not _HEX64_RE.fullmatch(c.raw_sha256):
            raise ValueError(f"stream {s.name!r}: chunk {i} has a malformed sha256")


def stream_from_dict(name: str, d: Any) -> StreamInfo:
    d = _require(d, dict, f"stream {name!r}")
    return StreamInfo(
        name=name,
        raw_size=_require(d["raw_size"], int, "raw_size"),
        chunk_size=_require(d["chunk_size"], int, "chunk_size"),
        chunking=_require(d.get("chunking") or FIXED, str, "chunking"),
        chunks=tuple(
            ChunkInfo(
                index=_require(c["index"], int, "index"),
                key=_require(c["key"], str, "key"),
                raw_size=_require(c["raw_size"], int, "raw_size"),
                stored_size=_require(c["stored_size"], int, "stored_size"),
                sha256=_require(c["sha256"], str, "sha256"),
                raw_sha256=_require(c["raw_sha256"], str, "raw_sha256"),
                xxh3=_require(c.get("xxh3", ""), str, "xxh3"),
            )
            for c in _require(d["chunks"], list, "chunks")
        ),
    )


def _require(value: Any, typ: type, what: str) -> Any:
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise TypeError(f"{what} should be {typ.__name__}, got {type(value).__name__}")
    return value


def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
