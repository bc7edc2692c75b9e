"""Per-tenant data keys for encryption at rest (sealing.py), wrapped by a key provider.

    keys/master.key                       the local provider's key-encryption key (32 bytes)
    keys/data/<tenant>/<key_id>.wrapped   one data key, wrapped by the provider
    keys/data/<tenant>/current            the key id the tenant's new snapshots are sealed with

All of it lives in the coordinator's home (0600 files in 0700 directories), never in the object
store: whoever reads the store reads only sealed chunks and manifests naming key ids. Agents get
a data key from the coordinator over the authenticated TLS channel for one upload or fetch, and
keep it in memory only.

Providers: `LocalKeyFile` wraps with AES-256-GCM under a key-encryption key in a local file
(additional data: tenant and key id, so a wrapped key moved to another tenant does not unwrap).
A KMS-style provider implements the same two calls with the KMS's Encrypt/Decrypt (or
GenerateDataKey) on a per-provider master key that never leaves the KMS; the wrapped bytes stay
here unchanged, and revoking the KMS key makes every snapshot sealed under it unreadable.

Rotation (`snapshotter keys rotate --tenant T`): a new data key becomes current; the old one is
kept, so the tenant's older snapshots still thaw, and its chunks are no longer deduplicated
against (new names). Deleting a tenant's directory crypto-shreds all of its snapshots.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from snapshotter.errors import InvalidArgument, KeyUnavailable
from snapshotter.storage import format as fmt
from snapshotter.storage.keyfile import create_once
from snapshotter.storage.sealing import KEY_BYTES, NONCE_BYTES, Seal, valid_key_id

MASTER_KEY = "master.key"
DATA = "data"
CURRENT = "current"
DEFAULT_TENANT = fmt.DEFAULT_TENANT


class KeyProvider(Protocol):
    """Wraps and unwraps data keys; the key that wraps them never leaves the provider."""

    name: str

    def wrap(self, tenant: str, key_id: str, key: bytes) -> bytes: ...

    def unwrap(self, tenant: str, key_id: str, wrapped: bytes) -> bytes: ...


def _aad(tenant: str, key_id: str) -> bytes:
    return f"snapshotter data key|{tenant}|{key_id}".encode()


class LocalKeyFile:
    """A key-encryption key in a local file, made on first use."""

    name = "local-key-file"

    def __init__(self, path: Path) -> None:
        create_once(path, secrets.token_bytes(KEY_BYTES))
        kek = path.read_bytes()
        if len(kek) != KEY_BYTES:
            raise InvalidArgument(
                f"key-encryption key {path} has {len(kek)} bytes, expected {KEY_BYTES}",
                "restore it from backup: without it no encrypted snapshot can be read",
            )
        self.path = path
        self._aead = AESGCM(kek)

    def wrap(self, tenant: str, key_id: str, key: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, key, _aad(tenant, key_id))

    def unwrap(self, tenant: str, key_id: str, wrapped: bytes) -> bytes:
        try:
            return self._aead.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:],
                                      _aad(tenant, key_id))  # fmt: skip
        except InvalidTag as e:
            raise KeyUnavailable(
                f"data key {key_id} of tenant {tenant!r} does not unwrap with {self.path}",
                "the key-encryption key was replaced or the wrapped key altered: restore "
                "both from the same backup",
            ) from e


class DataKeys:
    """The tenants' data keys of one coordinator. `root` None: in memory only (tests)."""

    def __init__(self, root: Path | None, provider: KeyProvider | None = None) -> None:
        self.root = root
        if provider is None and root is not None:
            provider = LocalKeyFile(root / MASTER_KEY)
        self.provider = provider
        self._lock = threading.Lock()
        self._memory: dict[str, dict[str, bytes]] = {}
        self._current: dict[str, str] = {}
        self._cache: dict[tuple[str, str], Seal] = {}

    def _dir(self, tenant: str) -> Path:
        assert self.root is not None
        return self.root / DATA / fmt.validate_name(tenant, "tenant")

    def current(self, tenant: str = DEFAULT_TENANT) -> Seal:
        """The data key the tenant's new snapshots are sealed with (made on first use)."""
        with self._lock:
            key_id = self._current_id(tenant)
            if key_id is None:
                key_id = self._create(tenant)
        return self.get(tenant, key_id)

    def get(self, tenant: str, key_id: str) -> Seal:
        """The data key `key_id` of `tenant`. Raises KeyUnavailable."""
        fmt.validate_name(tenant, "tenant")
        valid_key_id(key_id)
        with self._lock:
            seal = self._cache.get((tenant, key_id))
            if seal is not None:
                return seal
            if self.root is None:
                raw = self._memory.get(tenant, {}).get(key_id)
            else:
                path = self._dir(tenant) / f"{key_id}.wrapped"
                raw = None
                if path.exists():
                    assert self.provider is not None
                    raw = self.provider.unwrap(tenant, key_id, path.read_bytes())
            if raw is None:
                where = "memory" if self.root is None else str(self._dir(tenant))
                raise KeyUnavailable(
                    f"data key {key_id} of tenant {tenant!r} is not held here ({where})",
                    "thaw through the coordinator that took the snapshot, or restore its "
                    "keys/ directory (data/ and master.key) from backup",
                )
            seal = Seal(tenant, key_id, raw)
            self._cache[(tenant, key_id)] = seal
            return seal

    def rotate(self, tenant: str = DEFAULT_TENANT) -> tuple[str | None, str]:
        """Make a new current data key for `tenant`; returns (old, new) key ids."""
        with self._lock:
            old = self._current_id(tenant)
            return old, self._create(tenant)

    def tenants(self) -> dict[str, tuple[str | None, list[str]]]:
        """Every tenant with keys: (current key id, all key ids)."""
        out: dict[str, tuple[str | None, list[str]]] = {}
        with self._lock:
            if self.root is None:
                for t, keys in self._memory.items():
                    out[t] = (self._current.get(t), sorted(keys))
                return out
            base = self.root / DATA
            for d in sorted(base.iterdir()) if base.is_dir() else []:
                ids = sorted(p.name.removesuffix(".wrapped") for p in d.glob("*.wrapped"))
                out[d.name] = (self._current_id(d.name), ids)
        return out

    def current_id(self, tenant: str) -> str | None:
        """The id of the tenant's current data key; None while it has none (none is made)."""
        with self._lock:
            return self._current_id(tenant)

    def _current_id(self, tenant: str) -> str | None:
        if self.root is None:
            return self._current.get(tenant)
        path = self._dir(tenant) / CURRENT
        return path.read_text().strip() if path.exists() else None

    def _create(self, tenant: str) -> str:
        key_id, key = secrets.token_hex(8), secrets.token_bytes(KEY_BYTES)
        if self.root is None:
            self._memory.setdefault(tenant, {})[key_id] = key
            self._current[tenant] = key_id
            return key_id
        assert self.provider is not None
        d = self._dir(tenant)
        create_once(d / f"{key_id}.wrapped", self.provider.wrap(tenant, key_id, key))
        tmp = d / f".{CURRENT}.{os.getpid()}"
        tmp.write_text(key_id + "\n")
        os.replace(tmp, d / CURRENT)  # the wrapped key is on disk before it becomes current
        return key_id
