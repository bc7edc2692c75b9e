"""The on-store snapshot format: key layout, manifest, and the rules that make one valid.

Layout, as a grammar over object keys (relative to the store's root):

    store     := snapshot*
    snapshot  := chunk* manifest?          ; committed  <=>  manifest present
    chunk     := "snapshots/" ID "/chunks/" STREAM "/" INDEX
    manifest  := "snapshots/" ID "/manifest.json"
    ID, STREAM:= [A-Za-z0-9][A-Za-z0-9._-]{0,127}
    INDEX     := 8 decimal digits, 00000000 .. 99999999

Objects:

    chunk     := zstd-frame(raw)           ; raw = bytes [INDEX*chunk_size, +chunk_size) of the
                                           ; stream; every chunk but the last is full-size
    manifest  := UTF-8 JSON {
                   "format": "snapshotter-snapshot", "version": 1,
                   "snapshot_id": ID, "created_at": unix seconds (float),
                   "meta": {...},          ; the caller's, opaque to storage
                   "streams": { STREAM: { "raw_size": int, "chunk_size": int,
                                          "chunks": [ chunk_entry* ] } },
                   "checksum": hex sha256 of the canonical JSON of all other fields }
    chunk_entry := { "index": int, "key": chunk key, "raw_size": int, "stored_size": int,
                     "sha256": hex sha256 of the stored (compressed) bytes,
                     "raw_sha256": hex sha256 of the raw bytes }

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
from typing import Any

FORMAT_NAME = "snapshotter-snapshot"
FORMAT_VERSION = 1
SNAPSHOTS_PREFIX = "snapshots/"
MANIFEST_NAME = "manifest.json"
MAX_CHUNKS = 100_000_000

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX64_RE = re.compile(r"[0-9a-f]{64}")


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


def chunk_key(snapshot_id: str, stream: str, index: int) -> str:
    validate_name(stream, "stream name")
    if not 0 <= index < MAX_CHUNKS:
        raise ValueError(f"chunk index {index} out of range")
    return f"{snapshot_prefix(snapshot_id)}chunks/{stream}/{index:08d}"


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
    sha256: str  # of the stored (compressed) bytes
    raw_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "key": self.key,
            "raw_size": self.raw_size,
            "stored_size": self.stored_size,
            "sha256": self.sha256,
            "raw_sha256": self.raw_sha256,
        }


@dataclass(frozen=True)
class StreamInfo:
    name: str
    raw_size: int
    chunk_size: int
    chunks: tuple[ChunkInfo, ...]

    @property
    def stored_size(self) -> int:
        return sum(c.stored_size for c in self.chunks)

    def offset(self, index: int) -> int:
        """Byte offset of chunk `index` in the raw stream."""
        return index * self.chunk_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "raw_size": self.raw_size,
            "chunk_size": self.chunk_size,
            "chunks": [c.to_dict() for c in self.chunks],
        }


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    created_at: float
    meta: Mapping[str, Any]
    streams: Mapping[str, StreamInfo] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def raw_size(self) -> int:
        return sum(s.raw_size for s in self.streams.values())

    @property
    def stored_size(self) -> int:
        return sum(s.stored_size for s in self.streams.values())

    def chunks(self) -> list[tuple[StreamInfo, ChunkInfo]]:
        return [(s, c) for s in self.streams.values() for c in s.chunks]

    def _body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "snapshot_id": self.snapshot_id,
            "created_at": self.created_at,
            "meta": dict(self.meta),
            "streams": {name: s.to_dict() for name, s in sorted(self.streams.items())},
        }

    def to_json(self) -> bytes:
        """Serialize with a self-checksum. Raises ManifestError if `meta` is not JSON."""
        validate(self)
        body = self._body()
        try:
            body["checksum"] = sha256_hex(_canonical(body))
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest meta is not JSON-serializable: {e}") from e
        return json.dumps(body, sort_keys=True, indent=1).encode()

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
        if body.get("version") != FORMAT_VERSION:
            raise ManifestError(
                f"manifest version {body.get('version')!r} is not supported "
                f"(this snapshotter reads version {FORMAT_VERSION})"
            )
        checksum = body.pop("checksum", None)
        if checksum != sha256_hex(_canonical(body)):
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is malformed: {e!r}") from e
        validate(manifest)
        return manifest


def validate(manifest: Manifest) -> None:
    """Check the rules of the grammar above. Raises ManifestError."""
    try:
        validate_name(manifest.snapshot_id)
        for name, stream in manifest.streams.items():
            validate_name(name, "stream name")
            if name != stream.name:
                raise ValueError(f"stream {name!r} carries name {stream.name!r}")
            _validate_stream(manifest.snapshot_id, stream)
    except ValueError as e:
        raise ManifestError(str(e)) from e


def _validate_stream(snapshot_id: str, s: StreamInfo) -> None:
    n = chunk_count(s.raw_size, s.chunk_size)
    if len(s.chunks) != n:
        raise ValueError(
            f"stream {s.name!r}: {len(s.chunks)} chunks for {s.raw_size} bytes "
            f"at chunk size {s.chunk_size} (expected {n})"
        )
    for i, c in enumerate(s.chunks):
        want = min(s.chunk_size, s.raw_size - s.offset(i))
        if c.index != i or c.key != chunk_key(snapshot_id, s.name, i) or c.raw_size != want:
            raise ValueError(f"stream {s.name!r}: chunk entry {i} is inconsistent: {c}")
        if c.stored_size < 0:
            raise ValueError(f"stream {s.name!r}: chunk {i} has negative stored size")
        if not (_HEX64_RE.fullmatch(c.sha256) and _HEX64_RE.fullmatch(c.raw_sha256)):
            raise ValueError(f"stream {s.name!r}: chunk {i} has a malformed sha256")


def stream_from_dict(name: str, d: Any) -> StreamInfo:
    d = _require(d, dict, f"stream {name!r}")
    return StreamInfo(
        name=name,
        raw_size=_require(d["raw_size"], int, "raw_size"),
        chunk_size=_require(d["chunk_size"], int, "chunk_size"),
        chunks=tuple(
            ChunkInfo(
                index=_require(c["index"], int, "index"),
                key=_require(c["key"], str, "key"),
                raw_size=_require(c["raw_size"], int, "raw_size"),
                stored_size=_require(c["stored_size"], int, "stored_size"),
                sha256=_require(c["sha256"], str, "sha256"),
                raw_sha256=_require(c["raw_sha256"], str, "raw_sha256"),
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
