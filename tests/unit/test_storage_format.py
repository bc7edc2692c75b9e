"""The on-store format: names, keys, chunk math, manifest round trip and validation."""

from __future__ import annotations

import json

import pytest

from snapshotter.storage import format as fmt
from snapshotter.storage.api import check_key

pytestmark = pytest.mark.timeout(10)


def _stream(snapshot_id: str, name: str, raw_size: int, chunk_size: int) -> fmt.StreamInfo:
    chunks = []
    for i in range(fmt.chunk_count(raw_size, chunk_size)):
        raw = min(chunk_size, raw_size - i * chunk_size)
        chunks.append(
            fmt.ChunkInfo(
                index=i,
                key=fmt.chunk_key(snapshot_id, name, i),
                raw_size=raw,
                stored_size=raw // 2 + 1,
                sha256=fmt.sha256_hex(b"stored%d" % i),
                raw_sha256=fmt.sha256_hex(b"raw%d" % i),
            )
        )
    return fmt.StreamInfo(name=name, raw_size=raw_size, chunk_size=chunk_size, chunks=tuple(chunks))


def _manifest(**meta: object) -> fmt.Manifest:
    sid = "job-1.0001"
    return fmt.Manifest(
        snapshot_id=sid,
        created_at=1700000000.125,
        meta=meta or {"job": {"id": "j1", "ranks": 2}, "note": "ünïcode"},
        streams={
            "rank-0": _stream(sid, "rank-0", 10 * 1024 + 7, 1024),
            "rank-1": _stream(sid, "rank-1", 4096, 1024),
            "empty": _stream(sid, "empty", 0, 1024),
        },
    )


@pytest.mark.parametrize("name", ["a", "job-1", "Job_2.snap", "0" * 128, "x.y-z_1"])
def test_valid_names(name: str) -> None:
    assert fmt.validate_name(name) == name


@pytest.mark.parametrize(
    "name", ["", ".hidden", "-x", "a/b", "../x", "a b", "a\x00", "0" * 129, "é", "a:b", "_x"]
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid snapshot id"):
        fmt.validate_name(name)


def test_keys() -> None:
    assert fmt.snapshot_prefix("s1") == "snapshots/s1/"
    assert fmt.manifest_key("s1") == "snapshots/s1/manifest.json"
    assert fmt.chunk_key("s1", "rank-0", 0) == "snapshots/s1/chunks/rank-0/00000000"
    assert fmt.chunk_key("s1", "rank-0", 12345678) == "snapshots/s1/chunks/rank-0/12345678"
    with pytest.raises(ValueError):
        fmt.chunk_key("s1", "rank-0", fmt.MAX_CHUNKS)
    with pytest.raises(ValueError):
        fmt.chunk_key("s1", "../x", 0)
    with pytest.raises(ValueError):
        fmt.manifest_key("../etc")
    # Keys sort in chunk order, which listing and debugging rely on.
    keys = [fmt.chunk_key("s", "r", i) for i in (0, 9, 10, 99, 100)]
    assert keys == sorted(keys)


@pytest.mark.parametrize(
    ("raw", "chunk", "count"),
    [(0, 8, 0), (1, 8, 1), (8, 8, 1), (9, 8, 2), (16, 8, 2), (17, 8, 3), (10**12, 8 << 20, 119210)],
)
def test_chunk_count(raw: int, chunk: int, count: int) -> None:
    assert fmt.chunk_count(raw, chunk) == count


def test_chunk_count_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        fmt.chunk_count(10, 0)
    with pytest.raises(ValueError):
        fmt.chunk_count(-1, 8)


def test_stream_offsets_and_sizes() -> None:
    s = _stream("s", "r", 2500, 1000)
    assert [c.raw_size for c in s.chunks] == [1000, 1000, 500]
    assert [s.offset(c.index) for c in s.chunks] == [0, 1000, 2000]
    assert s.stored_size == sum(c.stored_size for c in s.chunks)


def test_manifest_round_trip() -> None:
    m = _manifest()
    data = m.to_json()
    back = fmt.Manifest.from_json(data)
    assert back == fmt.Manifest(
        snapshot_id=m.snapshot_id,
        created_at=m.created_at,
        meta=m.meta,
        streams=m.streams,
    )
    assert back.raw_size == 10 * 1024 + 7 + 4096
    assert len(back.chunks()) == 11 + 4
    body = json.loads(data)
    assert body["format"] == fmt.FORMAT_NAME and body["version"] == fmt.FORMAT_VERSION
    assert len(body["checksum"]) == 64
    # Written in the canonical form itself (sorted keys, compact), checksum included.
    assert data == json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    sealed = fmt.Manifest("x", 0.0, {}, {}, version=fmt.SEALED_VERSION,
                          sealed=fmt.Sealing("t1", "0123456789abcdef"))  # fmt: skip
    data = sealed.to_json()
    assert data == json.dumps(json.loads(data), sort_keys=True, separators=(",", ":")).encode()


def test_manifest_checksum_detects_edit() -> None:
    body = json.loads(_manifest().to_json())
    body["streams"]["rank-0"]["chunks"][3]["sha256"] = "0" * 64
    with pytest.raises(fmt.ManifestError, match="checksum"):
        fmt.Manifest.from_json(json.dumps(body).encode())


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", b"[]", b"{}", b'{"format": "other"}', b"not json"],
)
def test_manifest_garbage(data: bytes) -> None:
    with pytest.raises(fmt.ManifestError):
        fmt.Manifest.from_json(data)


def test_manifest_unknown_version() -> None:
    body = json.loads(_manifest().to_json())
    body["version"] = 99
    with pytest.raises(fmt.ManifestError, match="version 99"):
        fmt.Manifest.from_json(json.dumps(body).encode())


def _resigned(body: dict[str, object]) -> bytes:
    body.pop("checksum", None)
    body["checksum"] = fmt.sha256_hex(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    return json.dumps(body).encode()


def test_manifest_rules_checked_even_with_valid_checksum() -> None:
    body = json.loads(_manifest().to_json())
    del body["streams"]["rank-0"]["chunks"][5]  # a hole
    with pytest.raises(fmt.ManifestError, match="chunks for"):
        fmt.Manifest.from_json(_resigned(body))

    body = json.loads(_manifest().to_json())
    body["streams"]["rank-1"]["chunks"][0]["key"] = "snapshots/other/chunks/rank-1/00000000"
    with pytest.raises(fmt.ManifestError, match="inconsistent"):
        fmt.Manifest.from_json(_resigned(body))

    body = json.loads(_manifest().to_json())
    body["streams"]["rank-1"]["chunks"][0]["raw_size"] = True
    with pytest.raises(fmt.ManifestError, match="malformed"):
        fmt.Manifest.from_json(_resigned(body))

    body = json.loads(_manifest().to_json())
    body["streams"]["../x"] = body["streams"].pop("rank-1")
    with pytest.raises(fmt.ManifestError, match="stream name"):
        fmt.Manifest.from_json(_resigned(body))


def test_manifest_meta_must_be_json() -> None:
    with pytest.raises(fmt.ManifestError, match="JSON"):
        _manifest(bad=object()).to_json()


@pytest.mark.parametrize("key", ["a", "a/b", "snapshots/x/chunks/r/00000001"])
def test_check_key_accepts(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key", ["", "/a", "a//b", "a/", "../a", "a/./b", "a/.tmp-x", "a\\b"])
def test_check_key_rejects(key: str) -> None:
    with pytest.raises(ValueError):
        check_key(key)


def _content_stream(name: str, sizes: list[int]) -> fmt.StreamInfo:
    chunks = []
    for i, n in enumerate(sizes):
        sha = fmt.sha256_hex(b"raw%d" % i)
        chunks.append(fmt.ChunkInfo(i, fmt.content_key(sha), n, n // 3, "", sha, "ab" * 16))
    return fmt.StreamInfo(name, sum(sizes), max(sizes), tuple(chunks), chunking=fmt.CONTENT)


def test_format_2_round_trip_with_variable_chunks_and_offsets() -> None:
    s = _content_stream("rank-0", [300, 4096, 17, 4096])
    m = fmt.Manifest("job-2.0001", 1.5, {}, {"rank-0": s})
    back = fmt.Manifest.from_json(m.to_json())
    assert back == m and back.version == 2
    assert [back.streams["rank-0"].offset(i) for i in range(4)] == [0, 300, 4396, 4413]
    assert back.content_keys() == {c.key for c in s.chunks}
    assert s.chunks[0].key.startswith("chunks/") and fmt.version_for({"rank-0": s}) == 2


def test_format_2_entries_are_checked() -> None:
    good = _content_stream("rank-0", [10, 20])
    wrong = fmt.ChunkInfo(
        1, fmt.content_key("0" * 64), 20, 5, "", good.chunks[1].raw_sha256, "ab" * 16
    )
    bad_key = fmt.StreamInfo("rank-0", 30, 20, (good.chunks[0], wrong), chunking=fmt.CONTENT)
    too_big = fmt.StreamInfo("rank-0", 30, 10, good.chunks, chunking=fmt.CONTENT)
    wrong_sum = fmt.StreamInfo("rank-0", 31, 20, good.chunks, chunking=fmt.CONTENT)
    for s in (bad_key, too_big, wrong_sum):
        with pytest.raises(fmt.ManifestError):
            fmt.Manifest("x", 0.0, {}, {"rank-0": s}).to_json()
    # A version-1 manifest cannot list shared chunks (an old reader would misread them).
    with pytest.raises(fmt.ManifestError, match="version-1"):
        fmt.Manifest("x", 0.0, {}, {"rank-0": good}, version=1).to_json()


def test_versions_read_and_refused() -> None:
    v1 = _manifest()
    body = json.loads(v1.to_json())
    body["version"] = 1
    body.pop("checksum")
    body["checksum"] = fmt.sha256_hex(fmt._canonical(body))
    assert fmt.Manifest.from_json(json.dumps(body).encode()).version == 1
    body["version"] = 4
    body.pop("checksum")
    body["checksum"] = fmt.sha256_hex(fmt._canonical(body))
    with pytest.raises(fmt.ManifestError, match="upgrade"):
        fmt.Manifest.from_json(json.dumps(body).encode())
    # Version 3 is a sealed snapshot: it must say whose key, and a sealed one must be 3.
    body["version"] = 3
    body.pop("checksum")
    body["checksum"] = fmt.sha256_hex(fmt._canonical(body))
    with pytest.raises(fmt.ManifestError, match="sealed=None"):
        fmt.Manifest.from_json(json.dumps(body).encode())


def test_an_unset_chunking_from_a_message_is_fixed() -> None:
    d = _stream("s", "rank-0", 2048, 1024).to_dict()
    d["chunking"] = ""  # what a proto StreamInfo without the field reads as
    assert fmt.stream_from_dict("rank-0", d).chunking == fmt.FIXED
