"""Encryption at rest: a tenant's chunks sealed with AES-256-GCM under the tenant's data key.

    sealed object := "SNPe" KEY_ID NONCE AES-GCM(enc_key, NONCE, inner, aad=KEY)
    KEY_ID        := 16 ASCII hex digits, the data key's id (datakeys.py)
    NONCE         := 12 random bytes
    inner         := codec.py's object ("SNP" CODEC payload): compressed first, then sealed

KEY is the object's key in the store, so an object copied to another key does not open. A
sealed snapshot (format version 3) names its chunks by a keyed digest of their content and
lists that digest in its manifest where an unsealed one lists sha256:

    digest(raw) := HMAC-SHA256(name_key, sha256(raw))          ; the chunk's key and check
    fast(raw)   := HMAC-SHA256(name_key, xxh3_128(raw))[:32]    ; the dedup fast path

Without the tenant's key neither the store nor the manifest tells anything about content (no
confirming a guessed page by its hash), and two tenants' equal pages get different names: dedup
happens within a tenant only. The reader checks digest(raw) after opening and decoding, so a
chunk replaced together with its manifest entry is caught by the manifest's signature, and one
replaced alone by GCM's tag.

enc_key and name_key come from the 32-byte data key through HKDF-SHA256 with distinct labels:
no key serves two purposes. Nonces are random: a data key must seal fewer than 2**32 objects
(about 6 PiB of 1.5 MiB chunks); rotate it long before (`snapshotter keys rotate --tenant`).
This module is pure computation: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"SNPe"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_ID_CHARS = 16
HEADER = len(MAGIC) + KEY_ID_CHARS + NONCE_BYTES
_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")


class SealError(ValueError):
    """A sealed object that does not open under this key (damaged, moved, or another key's)."""


def valid_key_id(key_id: str) -> str:
    if not isinstance(key_id, str) or not _KEY_ID_RE.fullmatch(key_id):
        raise ValueError(f"malformed data key id {key_id!r} (16 hex digits)")
    return key_id


def _derive(key: bytes, label: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"snapshotter/v1 " + label).derive(key)  # fmt: skip


class Seal:
    """One tenant data key, ready to seal and open chunks. Holds key material: never logged,
    never stored (its repr shows the ids only)."""

    def __init__(self, tenant: str, key_id: str, key: bytes) -> None:
        valid_key_id(key_id)
        if len(key) != KEY_BYTES:
            raise ValueError(f"a data key has {KEY_BYTES} bytes, got {len(key)}")
        self.tenant = tenant
        self.key_id = key_id
        self.key = key
        self._aead = AESGCM(_derive(key, b"chunk encryption"))
        self._names = _derive(key, b"chunk names")

    def __repr__(self) -> str:
        return f"Seal(tenant={self.tenant!r}, key_id={self.key_id!r})"

    def digest(self, raw_sha256: str) -> str:
        """The keyed content digest of a chunk whose raw bytes have this sha256 (64 hex)."""
        return hmac.new(self._names, bytes.fromhex(raw_sha256), hashlib.sha256).hexdigest()

    def fast(self, xxh3: str) -> str:
        """The keyed form of a chunk's xxh3-128 (32 hex), for the dedup fast path."""
        mac = hmac.new(self._names, b"xxh3:" + bytes.fromhex(xxh3), hashlib.sha256)
        return mac.hexdigest()[:32]

    def seal(self, key: str, inner: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        body = self._aead.encrypt(nonce, inner, key.encode())
        return MAGIC + self.key_id.encode() + nonce + body

    def open(self, key: str, stored: bytes | bytearray | memoryview) -> bytes:
        """The inner (codec) object of `stored`. Raises SealError."""
        view = memoryview(stored)
        if len(view) < HEADER + TAG_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
            raise SealError("is not a sealed chunk object (stored in plaintext, or damaged)")
        key_id = bytes(view[len(MAGIC) : len(MAGIC) + KEY_ID_CHARS]).decode("ascii", "replace")
        if key_id != self.key_id:
            raise SealError(f"is sealed under data key {key_id!r}, not {self.key_id!r}")
        nonce = bytes(view[len(MAGIC) + KEY_ID_CHARS : HEADER])
        try:
            return self._aead.decrypt(nonce, view[HEADER:], key.encode())
        except InvalidTag as e:
            raise SealError("fails its AES-GCM tag (altered, or moved from another key)") from e


def is_sealed(stored: bytes | bytearray | memoryview) -> bool:
    return bytes(memoryview(stored)[: len(MAGIC)]) == MAGIC
