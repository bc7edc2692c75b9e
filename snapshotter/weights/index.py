"""What one published version of a channel holds: its tensors, where each lies in the
version's file, and a digest of each (xxh3-64 of its bytes).

The index travels between agents (WeightsIndex) and to the ranks (a JSON file beside the
data), so reading one checks everything a peer could get wrong. Decisions on it are pure:
which tensors changed since the version a node already holds (only those travel), and
which tree parent a node pulls from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from snapshotter.checkpoint import catalog
from snapshotter.errors import InvalidArgument

# dtype name -> bytes per element: what a rank can rebuild without pickle.
DTYPES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip
MAX_TENSORS = 1_000_000
MAX_NAME = 1024
MAX_BYTES = 1 << 44  # 16 TiB: far above any one node's share
_CHANNEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_NEXT = "use the same snapshotter version on every node"


def check_channel(name: str) -> str:
    """Raises: InvalidArgument unless `name` is a channel name (it names files)."""
    if not isinstance(name, str) or not _CHANNEL.match(name):
        raise InvalidArgument(
            f"weights channel {name!r} is not a valid name",
            "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return name


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int
    digest: str = ""  # xxh3-64 hex of the bytes; "" until the publisher's agent computed it

    def same_bytes(self, other: Entry | None) -> bool:
        return (other is not None and bool(self.digest) and self.digest == other.digest
                and self.length == other.length)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "length": self.length, "digest": self.digest}  # fmt: skip


@dataclass(frozen=True)
class Index:
    """A version's tensors, laid out page-aligned in publication order."""

    channel: str
    lineage: str  # the publishing job: versions are ordered within one lineage
    version: int
    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        return max((e.offset + e.length for e in self.entries), default=0)

    def by_name(self) -> dict[str, Entry]:
        return {e.name: e for e in self.entries}

    def to_json(self) -> bytes:
        return json.dumps({"channel": self.channel, "lineage": self.lineage,
                           "version": self.version,
                           "tensors": [e.to_dict() for e in self.entries]},
                          separators=(",", ":")).encode()  # fmt: skip

    def with_digests(self, digests: Sequence[str]) -> Index:
        es = tuple(Entry(e.name, e.dtype, e.shape, e.offset, e.length, d)
                   for e, d in zip(self.entries, digests, strict=True))  # fmt: skip
        return Index(self.channel, self.lineage, self.version, es)


def new_index(channel: str, lineage: str, version: int,
              tensors: Sequence[tuple[str, str, Sequence[int]]]) -> Index:  # fmt: skip
    """An index of (name, dtype, shape) in order, laid out page-aligned (no digests yet).

    Raises: InvalidArgument for a bad name, dtype, shape, version or a repeated name."""
    lengths = [_length(dtype, shape, name) for name, dtype, shape in tensors]
    offsets = catalog.layout(lengths)
    entries = tuple(
        Entry(_name(n), d, tuple(s), o, ln)
        for (n, d, s), o, ln in zip(tensors, offsets, lengths, strict=True)
    )
    return _checked(Index(check_channel(channel), lineage, version, entries))


def parse_index(data: bytes) -> Index:
    """An index from a peer or a file, checked whole.

    Raises: InvalidArgument naming what is wrong."""
    try:
        d = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"weights index is not JSON: {e}", _NEXT) from e
    if not isinstance(d, dict) or not isinstance(d.get("tensors"), list):
        raise InvalidArgument("weights index has no tensors", _NEXT)
    raw = d["tensors"]
    if len(raw) > MAX_TENSORS:
        raise InvalidArgument(f"weights index lists {len(raw)} tensors", _NEXT)
    entries = []
    for t in raw:
        if not isinstance(t, dict):
            raise InvalidArgument("weights index entry is not an object", _NEXT)
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(_is_int(x) and x >= 0 for x in shape):
            raise InvalidArgument(f"weights index shape of {t.get('name')!r} is malformed", _NEXT)
        digest = t.get("digest", "")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{0,16}", digest):
            raise InvalidArgument(f"weights index digest of {t.get('name')!r} is malformed", _NEXT)
        entries.append(Entry(_name(t.get("name")), _dtype(t.get("dtype")), tuple(shape),
                             _nonneg(t.get("offset")), _nonneg(t.get("length")),
                             digest))  # fmt: skip
    lineage, version = d.get("lineage"), d.get("version")
    if not isinstance(lineage, str) or len(lineage) > 256 or not isinstance(version, int):
        raise InvalidArgument("weights index names no lineage or version", _NEXT)
    return _checked(Index(check_channel(d.get("channel", "")), lineage, version,
                          tuple(entries)))  # fmt: skip


def _checked(ix: Index) -> Index:
    if not 1 <= ix.version < 1 << 62:
        raise InvalidArgument(f"weights version {ix.version} is out of range",
                              "publish versions counting up from 1")  # fmt: skip
    names = set()
    end = 0
    for e in sorted(ix.entries, key=lambda e: e.offset):
        if e.name in names:
            raise InvalidArgument(f"weights tensor {e.name!r} appears twice",
                                  "publish a state dict (one tensor per name)")  # fmt: skip
        names.add(e.name)
        if e.length != _length(e.dtype, e.shape, e.name) or e.offset < end:
            raise InvalidArgument(f"weights index entry {e.name!r} overlaps or mis-sizes", _NEXT)
        end = e.offset + e.length
    if end > MAX_BYTES:
        raise InvalidArgument(f"weights version of {end} bytes is too large", _NEXT)
    return ix


def changed(new: Index, held: Index | None) -> list[str]:
    """The tensors of `new` a node holding `held` must fetch: those not there byte for byte."""
    old = held.by_name() if held is not None else {}
    return [e.name for e in new.entries if not e.same_bytes(old.get(e.name))]


def tree_parent(order: Sequence[str], node: str, usable: Callable[[str], bool]) -> str | None:
    """Whom `node` pulls a version from: its parent in a binary tree over the nodes in the
    order they took the version (the publisher is the root, None here), skipping up past
    parents that failed or left. Each node then serves at most two others, so the
    publisher's link carries the version about twice, whatever the number of replicas."""
    if node not in order:
        return None
    p = order.index(node) + 1  # the publisher is position 0
    while True:
        p = (p - 1) // 2
        if p == 0:
            return None
        parent = order[p - 1]
        if usable(parent):
            return parent


def tree_order(taken: Iterable[str], node: str) -> list[str]:
    """`taken` with `node` appended if new: positions 1.. of the tree (0 is the publisher)."""
    out = list(taken)
    if node not in out:
        out.append(node)
    return out


def _length(dtype: str, shape: Sequence[int], name: str) -> int:
    size = DTYPES.get(dtype)
    if size is None:
        raise InvalidArgument(f"weights tensor {name!r} has dtype {dtype!r}, which is not sent",
                              f"publish tensors of {', '.join(sorted(DTYPES))}")  # fmt: skip
    n = 1
    for x in shape:
        if not _is_int(x) or x < 0:
            raise InvalidArgument(f"weights tensor {name!r} has a bad shape", _NEXT)
        n *= x
    return n * size


def _name(v: Any) -> str:
    if not isinstance(v, str) or not v or len(v) > MAX_NAME or "\0" in v:
        raise InvalidArgument(f"weights tensor name {v!r} is malformed", _NEXT)
    return v


def _dtype(v: Any) -> str:
    if v not in DTYPES:
        raise InvalidArgument(f"weights index dtype {v!r} is not known", _NEXT)
    return str(v)


def _nonneg(v: Any) -> int:
    if not _is_int(v) or v < 0:
        raise InvalidArgument("weights index offset or length is malformed", _NEXT)
    return int(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
