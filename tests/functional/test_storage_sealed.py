"""Encryption at rest against real stores (a local directory and SeaweedFS S3): a sealed
snapshot keeps no plaintext byte in the store, restores bit-identical with its tenant's key and
with no other, deduplicates within a tenant only, and any altered or swapped chunk is caught
before it is restored."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from snapshotter.errors import KeyUnavailable, SnapshotCorrupt
from snapshotter.storage import ObjectStore, SnapshotReader, SnapshotWriter
from snapshotter.storage import format as fmt
from snapshotter.storage.datakeys import DataKeys
from snapshotter.storage.sealing import Seal, is_sealed

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20


def _image(root: Path, marker: bytes) -> Path:
    """A rank's image: a marker repeated through compressible pages, then random pages."""
    root.mkdir(parents=True)
    (root / "pages-1.img").write_bytes((b"\0" * 4000 + marker) * 900 + os.urandom(3 * MiB))
    (root / "core-1.img").write_bytes(marker + os.urandom(700))
    return root


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _write(store: ObjectStore, sid: str, src: Path, seal: Seal | None,
           seed: object = ()) -> SnapshotWriter:  # fmt: skip
    with SnapshotWriter(store, sid, chunk_size=MiB, seal=seal, seed=seed) as w:  # type: ignore[arg-type]
        w.add_directory("rank-0", src)
        w.commit({"job": "sealed"})
    return w


def _all_bytes(store: ObjectStore) -> list[tuple[str, bytes]]:
    return [(o.key, store.get_bytes(o.key)) for o in store.list_objects("")]


def test_no_plaintext_reaches_the_store_and_the_tenant_key_restores_it(
    store: ObjectStore, tmp_path: Path
) -> None:
    marker = b"TENANT-SECRET-" + os.urandom(6).hex().encode()
    src = _image(tmp_path / "src", marker)
    keys = DataKeys(tmp_path / "keys")
    seal = keys.current("acme")
    first = _write(store, "acme-0001", src, seal)
    objects = _all_bytes(store)
    assert [k for k, data in objects if marker in data] == []
    chunks = [(k, d) for k, d in objects if fmt.is_content_key(k)]
    assert chunks and all(is_sealed(d) for _, d in chunks)
    m = SnapshotReader(store, "acme-0001").manifest()  # listing needs no key
    assert m.version == 3 and m.sealed == fmt.Sealing("acme", seal.key_id)

    # Restored bit-identical with the key a restarted coordinator unwraps from its files.
    key = DataKeys(tmp_path / "keys").get("acme", seal.key_id)
    out = SnapshotReader(store, "acme-0001", seal=key).fetch_and_extract(
        {"rank-0": tmp_path / "out"})  # fmt: skip
    assert _tree(out["rank-0"]) == _tree(src)
    # Without it, or with another tenant's, nothing is restored.
    with pytest.raises(KeyUnavailable, match="no key was given"):
        SnapshotReader(store, "acme-0001").fetch_and_extract({"rank-0": tmp_path / "o2"})
    with pytest.raises(KeyUnavailable, match="not under the given"):
        SnapshotReader(store, "acme-0001", seal=keys.current("globex")).manifest()
    assert not (tmp_path / "o2").exists()

    # Dedup within the tenant: the same image again uploads nothing, seeded or not.
    assert _write(store, "acme-0002", src, seal, seed=m.streams.values()).uploaded_bytes == 0
    assert _write(store, "acme-0003", src, seal).uploaded_bytes == 0
    # Across tenants: the same bytes are stored again, under other names.
    other = _write(store, "globex-0001", src, keys.current("globex"))
    assert other.uploaded_bytes >= 0.9 * first.uploaded_bytes
    globex = SnapshotReader(store, "globex-0001").manifest().content_keys()
    assert globex.isdisjoint(m.content_keys())


def test_an_altered_or_swapped_sealed_chunk_is_caught_before_anything_is_restored(
    store: ObjectStore, tmp_path: Path
) -> None:
    seal = DataKeys(None).current("acme")
    src = _image(tmp_path / "src", b"x" * 16)
    _write(store, "acme-0001", src, seal)
    m = SnapshotReader(store, "acme-0001").manifest()
    keys = sorted({c.key for _, c in m.chunks()})
    assert len(keys) >= 2
    one, two = store.get_bytes(keys[0]), store.get_bytes(keys[1])
    # Swapped: each a valid sealed object of this tenant, under the other's name.
    store.put_bytes(keys[0], two)
    store.put_bytes(keys[1], one)
    with pytest.raises(SnapshotCorrupt, match="AES-GCM"):
        SnapshotReader(store, "acme-0001", seal=seal).fetch_and_extract(
            {"rank-0": tmp_path / "out"})  # fmt: skip
    assert not (tmp_path / "out").exists()
    # Replaced by a plaintext object (someone writing around the encryption).
    store.put_bytes(keys[0], b"SNPn" + b"x" * 100)
    store.put_bytes(keys[1], two)
    with pytest.raises(SnapshotCorrupt, match="plaintext"):
        SnapshotReader(store, "acme-0001", seal=seal).fetch_and_extract(
            {"rank-0": tmp_path / "out"})  # fmt: skip
