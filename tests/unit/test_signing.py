"""Signed snapshots (storage/signing.py): what a thaw accepts, and key rotation."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from snapshotter.errors import SnapshotUntrusted
from snapshotter.storage import signing

BODY = b'{"snapshot_id": "job-1", "streams": {"rank-0": {"chunks": [{"raw_sha256": "ab"}]}}}'


def test_a_signed_manifest_verifies_and_any_change_is_refused(tmp_path: Path) -> None:
    signer, ring = signing.load(tmp_path / "keys")
    sig = signer.sign(BODY)
    assert ring.verify("job-1", BODY, sig) == signer.key_id
    with pytest.raises(SnapshotUntrusted, match="altered"):
        ring.verify("job-1", BODY.replace(b"ab", b"ac"), sig)
    doc = json.loads(sig)
    doc["sig"] = doc["sig"][:-4] + "AAA="
    with pytest.raises(SnapshotUntrusted, match="altered|malformed"):
        ring.verify("job-1", BODY, json.dumps(doc).encode())


@pytest.mark.parametrize("sig", [b"", b"not json", b'{"alg": "rsa"}', b'{"alg": "ed25519"}',
                                 b'{"alg": "ed25519", "key_id": "x", "sig": "@@"}',
                                 b"{" + b" " * 5000 + b"}"])  # fmt: skip
def test_malformed_signatures_are_refused_by_name(tmp_path: Path, sig: bytes) -> None:
    _, ring = signing.load(tmp_path / "keys")
    with pytest.raises(SnapshotUntrusted) as e:
        ring.verify("job-1", BODY, sig)
    assert e.value.next_step and ("malformed" in e.value.cause or "trust" in e.value.cause)


def test_unsigned_is_refused_unless_allowed_and_a_foreign_key_is_named(tmp_path: Path) -> None:
    _, ring = signing.load(tmp_path / "keys")
    with pytest.raises(SnapshotUntrusted, match="not signed"):
        ring.verify("job-1", BODY, None)
    assert ring.verify("job-1", BODY, None, allow_unsigned=True) == ""
    foreign = signing.Signer(Ed25519PrivateKey.generate())
    with pytest.raises(SnapshotUntrusted, match=f"key {foreign.key_id}.*not trust") as e:
        ring.verify("job-1", BODY, foreign.sign(BODY), allow_unsigned=True)
    assert "keys/trusted" in e.value.next_step
    # Trusted once its public key is placed in trusted/.
    (tmp_path / "keys" / "trusted").mkdir()
    (tmp_path / "keys" / "trusted" / "other.pub").write_bytes(
        signing.public_pem(foreign.private.public_key())
    )
    _, ring = signing.load(tmp_path / "keys")
    assert ring.verify("job-1", BODY, foreign.sign(BODY)) == foreign.key_id


def test_the_key_is_private_stable_and_rotation_keeps_old_snapshots_thawable(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    first, _ = signing.load(keys)
    assert stat.S_IMODE((keys / signing.SIGNING_KEY).stat().st_mode) == 0o600
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert signing.load(keys)[0].key_id == first.key_id  # loaded, not made again
    old_sig = first.sign(BODY)
    old, new = signing.rotate(keys)
    assert old == first.key_id and new != old
    signer, ring = signing.load(keys)
    assert signer.key_id == new and set(ring.keys) == {old, new}
    assert ring.verify("job-1", BODY, old_sig) == old
    assert ring.verify("job-1", BODY, signer.sign(BODY)) == new
    # The old private key is gone: only its public half remains.
    assert [p.name for p in keys.iterdir() if p.is_file()] == [signing.SIGNING_KEY]


def test_an_unreadable_key_file_names_the_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / signing.SIGNING_KEY).write_text("garbage")
    with pytest.raises(Exception, match="signing key") as e:
        signing.load(keys)
    assert str(keys / signing.SIGNING_KEY) in str(e.value)
