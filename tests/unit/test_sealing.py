"""Encryption at rest, pure parts: sealing a chunk object (AES-256-GCM bound to its key), the
keyed names that keep content and tenants apart, and the data keys a coordinator keeps wrapped
by its key provider (a real local key file here)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from snapshotter.errors import KeyUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.datakeys import DataKeys, LocalKeyFile
from snapshotter.storage.sealing import Seal, SealError, is_sealed

SHA = "ab" * 32
XXH = "cd" * 16


def _seal(tenant: str = "acme", byte: int = 7) -> Seal:
    return Seal(tenant, "0123456789abcdef", bytes([byte]) * 32)


def test_a_sealed_object_opens_only_under_its_key_and_its_name() -> None:
    s = _seal()
    inner = b"SNPn" + b"secret weights" * 100
    key = fmt.content_key(s.digest(SHA))
    sealed = s.seal(key, inner)
    assert is_sealed(sealed) and b"secret" not in sealed
    assert s.open(key, sealed) == inner
    assert s.seal(key, inner) != sealed  # a fresh nonce each time
    other = fmt.content_key(s.digest("ef" * 32))
    with pytest.raises(SealError, match="tag"):
        s.open(other, sealed)  # moved to another key
    flipped = bytearray(sealed)
    flipped[-1] ^= 1
    with pytest.raises(SealError, match="tag"):
        s.open(key, bytes(flipped))
    with pytest.raises(SealError, match="not '0123456789abcdef'"):
        s.open(key, sealed[:4] + b"fedcba9876543210" + sealed[20:])
    with pytest.raises(SealError, match="plaintext"):
        s.open(key, inner)
    with pytest.raises(SealError, match="tag"):
        _seal(byte=8).open(key, sealed)  # same id, other key bytes


def test_names_are_keyed_so_tenants_never_share_or_confirm_content() -> None:
    a, b = _seal("acme", 1), _seal("globex", 2)
    assert a.digest(SHA) == _seal("acme", 1).digest(SHA)  # stable: dedup within a tenant
    assert a.digest(SHA) != b.digest(SHA) != SHA  # not the plain hash, not the other's
    assert len(a.digest(SHA)) == 64 and len(a.fast(XXH)) == 32
    assert a.fast(XXH) != b.fast(XXH) and XXH not in a.fast(XXH)
    assert "key=" not in repr(a) and repr(a).startswith("Seal(tenant='acme'")
    with pytest.raises(ValueError, match="32 bytes"):
        Seal("acme", "0123456789abcdef", b"short")
    with pytest.raises(ValueError, match="key id"):
        Seal("acme", "XYZ", bytes(32))


def test_data_keys_are_wrapped_private_and_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "home" / "keys"
    keys = DataKeys(root)
    cur = keys.current("acme")
    assert keys.current("acme").key_id == cur.key_id  # made once
    again = DataKeys(root).get("acme", cur.key_id)  # a restarted coordinator
    assert again.key == cur.key
    wrapped = root / "data" / "acme" / f"{cur.key_id}.wrapped"
    assert cur.key not in wrapped.read_bytes()
    for p in (wrapped, root / "master.key"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    for d in (tmp_path / "home", root, root / "data", root / "data" / "acme"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    # Rotation: new snapshots get a new key; what the old one sealed still opens.
    old, new = keys.rotate("acme")
    assert (old, new) == (cur.key_id, DataKeys(root).current("acme").key_id) and old != new
    assert DataKeys(root).get("acme", old).key == cur.key
    assert DataKeys(root).tenants() == {"acme": (new, sorted([old, new]))}
    assert keys.current("globex").key != cur.key  # every tenant its own


def test_a_key_that_is_missing_moved_or_wrapped_by_another_master_is_refused(
    tmp_path: Path,
) -> None:
    root = tmp_path / "keys"
    cur = DataKeys(root).current("acme")
    with pytest.raises(KeyUnavailable, match="not held here"):
        DataKeys(root).get("acme", "00000000deadbeef")
    with pytest.raises(KeyUnavailable, match="not held here"):
        DataKeys(tmp_path / "other").get("acme", cur.key_id)
    # A wrapped key copied into another tenant's directory does not unwrap there.
    theirs = root / "data" / "globex"
    theirs.mkdir(mode=0o700)
    (theirs / f"{cur.key_id}.wrapped").write_bytes(
        (root / "data" / "acme" / f"{cur.key_id}.wrapped").read_bytes()
    )
    with pytest.raises(KeyUnavailable, match="does not unwrap"):
        DataKeys(root).get("globex", cur.key_id)
    # A replaced key-encryption key unwraps nothing it did not wrap.
    (root / "master.key").unlink()
    LocalKeyFile(root / "master.key")
    with pytest.raises(KeyUnavailable, match="restore both"):
        DataKeys(root).get("acme", cur.key_id)
    with pytest.raises(ValueError, match="invalid tenant"):
        DataKeys(root).current("../escape")


def test_a_sealed_manifest_says_whose_key_and_lists_only_shared_chunks() -> None:
    s = _seal()
    digest = s.digest(SHA)
    chunk = fmt.ChunkInfo(0, fmt.content_key(digest), 10, 40, "", digest, s.fast(XXH))
    stream = fmt.StreamInfo("rank-0", 10, 4096, (chunk,), chunking=fmt.CONTENT)
    m = fmt.Manifest("snap", 1.0, {}, {"rank-0": stream}, version=3,
                     sealed=fmt.Sealing("acme", s.key_id))  # fmt: skip
    back = fmt.Manifest.from_json(m.to_json())
    assert back.sealed == fmt.Sealing("acme", s.key_id) and back.version == 3
    assert fmt.version_for(m.streams, m.sealed) == 3
    with pytest.raises(fmt.ManifestError, match="sealed"):
        fmt.Manifest("snap", 1.0, {}, {"rank-0": stream}, version=2,
                     sealed=fmt.Sealing("acme", s.key_id)).to_json()  # fmt: skip
    with pytest.raises(fmt.ManifestError, match="key id"):
        fmt.Manifest("snap", 1.0, {}, {"rank-0": stream}, version=3,
                     sealed=fmt.Sealing("acme", "nothex")).to_json()  # fmt: skip
