"""Fixtures of the functional tests: every store test runs on a local directory and on S3; the
tenant and provider-API tests share a coordinator with two tenants (tests/support/tenants.py)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from snapshotter.storage import LocalDirStore, ObjectStore, S3Store
from tests.support.seaweed import SeaweedServer, seaweed_server  # noqa: F401 - fixture
from tests.support.tenants import cluster  # noqa: F401 - fixture


@dataclass
class Backend:
    """A store plus raw access to what lies under it, for tests that damage the store."""

    kind: str
    store: ObjectStore
    raw_put: Callable[[str, bytes], object]
    raw_delete: Callable[[str], object]


def _local_backend(root: Path) -> Backend:
    store = LocalDirStore(root)
    return Backend(
        "local",
        store,
        raw_put=lambda key, data: (root / key).write_bytes(data),
        raw_delete=lambda key: (root / key).unlink(),
    )


def _s3_backend(server: SeaweedServer, prefix: str) -> Backend:
    store = S3Store(server.bucket, prefix, **server.store_kwargs())
    client = server.client()
    return Backend(
        "s3",
        store,
        raw_put=lambda key, data: client.put_object(
            Bucket=server.bucket, Key=f"{prefix}/{key}", Body=data
        ),
        raw_delete=lambda key: client.delete_object(Bucket=server.bucket, Key=f"{prefix}/{key}"),
    )


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return _local_backend(tmp_path / "store")
    server: SeaweedServer = request.getfixturevalue("seaweed_server")
    return _s3_backend(server, f"tests/{uuid.uuid4().hex[:12]}")


@pytest.fixture
def store(backend: Backend) -> ObjectStore:
    return backend.store
