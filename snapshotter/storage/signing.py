"""Signed snapshots: who committed a manifest, checked before any byte of it is restored.

A snapshot is a process image restored as root. Its manifest lists every chunk's sha256, so a
signature over the manifest's exact bytes covers every byte of the snapshot: a chunk changed
together with its hash in the manifest no longer matches the signature.

    snapshots/<id>/manifest.json   the manifest (its write commits the snapshot)
    snapshots/<id>/manifest.sig    {"alg": "ed25519", "key_id": ..., "sig": base64}, written
                                   just before the manifest

The coordinator that commits signs with its Ed25519 key (`keys/signing.key` in its home, made
on first use, 0600; never stored beside the data). A thaw checks the signature against the
coordinator's keyring (its own key, and every `keys/trusted/*.pub`) before it fetches anything,
and hands the agents the manifest's sha256, so a manifest swapped in the store after the check
is refused too. Unsigned snapshots (taken before signing existed) thaw only when asked
(`thaw --allow-unsigned`).

Rotation (`snapshotter keys rotate`): the old public key moves to `keys/trusted/`, so what it
signed still thaws, its private key is deleted, and a new signing key is made. Another
coordinator trusts this one's snapshots once its `snapshotter keys show` public key is copied
into its `keys/trusted/`; removing a key from there distrusts what it signed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from snapshotter.errors import InvalidArgument, SnapshotUntrusted
from snapshotter.storage.keyfile import create_once

ALG = "ed25519"
SIGNING_KEY = "signing.key"
TRUSTED = "trusted"
_MAX_SIG_BYTES = 4096


def key_id(public: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its sha256."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@dataclass(frozen=True)
class Signer:
    private: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private.public_key())

    def sign(self, manifest_body: bytes) -> bytes:
        """The signature object stored beside a manifest with these exact bytes."""
        sig = self.private.sign(manifest_body)
        return json.dumps(
            {"alg": ALG, "key_id": self.key_id, "sig": base64.b64encode(sig).decode()},
            sort_keys=True,
        ).encode()


@dataclass(frozen=True)
class Keyring:
    """The public keys whose signatures a thaw accepts, by key id."""

    keys: dict[str, Ed25519PublicKey]

    def verify(
        self, snapshot_id: str, manifest_body: bytes, sig_body: bytes | None, *,
        allow_unsigned: bool = False,
    ) -> str:  # fmt: skip
        """The key id that signed `manifest_body` ("" for an allowed unsigned snapshot).

        Raises:
            SnapshotUntrusted: unsigned (and not allowed), signed by a key not in the ring,
                or a signature that does not match these bytes (the snapshot was altered).
        """
        if sig_body is None:
            if allow_unsigned:
                return ""
            raise SnapshotUntrusted(
                f"snapshot {snapshot_id!r} is not signed (taken before signing existed, or its "
                "signature was removed)",
                "thaw it with --allow-unsigned only if you know where it came from",
            )
        try:
            if len(sig_body) > _MAX_SIG_BYTES:
                raise ValueError(f"{len(sig_body)} bytes")
            doc = json.loads(sig_body)
            if not isinstance(doc, dict) or doc.get("alg") != ALG:
                raise ValueError("not an ed25519 signature object")
            kid, sig = str(doc["key_id"]), base64.b64decode(str(doc["sig"]), validate=True)
        except (ValueError, KeyError, TypeError, binascii.Error) as e:
            raise SnapshotUntrusted(
                f"snapshot {snapshot_id!r}: its signature object is malformed ({e})",
                "the store's copy was altered; thaw an older snapshot",
            ) from e
        public = self.keys.get(kid)
        if public is None:
            raise SnapshotUntrusted(
                f"snapshot {snapshot_id!r} is signed by key {kid}, which this coordinator does "
                f"not trust (it trusts {', '.join(sorted(self.keys)) or 'no key'})",
                "if that coordinator is yours, copy its `snapshotter keys show` public key into "
                "this coordinator's keys/trusted/ directory",
            )
        try:
            public.verify(sig, manifest_body)
        except InvalidSignature as e:
            raise SnapshotUntrusted(
                f"snapshot {snapshot_id!r}: its manifest does not match its signature by key "
                f"{kid}: the snapshot was altered after it was committed",
                "thaw an older snapshot, and find out who can write to the store",
            ) from e
        return kid


def manifest_digest(manifest_body: bytes) -> str:
    """What a thaw hands the agents: they refuse a manifest with other bytes."""
    return hashlib.sha256(manifest_body).hexdigest()


def load_signer(keys_dir: Path) -> Signer:
    """This coordinator's signing key, made (0600, in a 0700 directory) on first use."""
    path = keys_dir / SIGNING_KEY
    if not path.exists():
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        create_once(path, pem)
    try:
        loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise InvalidArgument(
            f"cannot read the snapshot signing key {path}: {e}",
            "restore it from backup, or move it away to make a new one (snapshots it "
            "signed then thaw only once its public key is in keys/trusted/)",
        ) from e
    if not isinstance(loaded, Ed25519PrivateKey):
        raise InvalidArgument(f"{path} is not an Ed25519 private key", "move it away")
    return Signer(loaded)


def load_keyring(keys_dir: Path, signer: Signer | None = None) -> Keyring:
    """The signer's own public key and every `trusted/*.pub` (PEM)."""
    keys: dict[str, Ed25519PublicKey] = {}
    if signer is not None:
        keys[signer.key_id] = signer.private.public_key()
    trusted = keys_dir / TRUSTED
    for p in sorted(trusted.glob("*.pub")) if trusted.is_dir() else []:
        try:
            public = serialization.load_pem_public_key(p.read_bytes())
        except (OSError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"trusted key {p} is unreadable: {e}", "fix or remove that file"
            ) from e
        if not isinstance(public, Ed25519PublicKey):
            raise InvalidArgument(f"trusted key {p} is not an Ed25519 public key",
                                  "remove that file")  # fmt: skip
        keys[key_id(public)] = public
    return Keyring(keys)


def load(keys_dir: Path | None) -> tuple[Signer, Keyring]:
    """A coordinator's signer and keyring from `keys_dir`; None: a key of its own in memory
    only, trusting nothing else (tests, throwaway coordinators)."""
    if keys_dir is None:
        signer = Signer(Ed25519PrivateKey.generate())
        return signer, Keyring({signer.key_id: signer.private.public_key()})
    signer = load_signer(keys_dir)
    return signer, load_keyring(keys_dir, signer)


def rotate(keys_dir: Path) -> tuple[str, str]:
    """Make a new signing key; the old one's public key stays trusted. Returns (old, new)
    key ids."""
    old = load_signer(keys_dir)
    trusted = keys_dir / TRUSTED
    trusted.mkdir(parents=True, exist_ok=True, mode=0o700)
    (trusted / f"{old.key_id}.pub").write_bytes(public_pem(old.private.public_key()))
    # The old private key is destroyed: what it signed is verified with its public key, and
    # nothing new can be signed with it.
    (keys_dir / SIGNING_KEY).unlink()
    new = load_signer(keys_dir)
    return old.key_id, new.key_id
