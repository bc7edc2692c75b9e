"""Storage URLs map to the right backend; S3 settings come the AWS way. No network."""

from __future__ import annotations

from pathlib import Path

import pytest

from snapshotter.errors import InvalidArgument
from snapshotter.storage import LocalDirStore, S3Store, open_store

pytestmark = pytest.mark.timeout(10)

_AWS_VARS = [
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
]


@pytest.fixture(autouse=True)
def clean_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for v in _AWS_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")


def test_file_url_and_plain_path(tmp_path: Path) -> None:
    s = open_store(f"file://{tmp_path}/store")
    assert isinstance(s, LocalDirStore) and s.root == tmp_path / "store"
    s = open_store(str(tmp_path / "plain"))
    assert isinstance(s, LocalDirStore) and s.root == tmp_path / "plain"
    assert str(tmp_path) in s.describe()


def test_s3_url_with_endpoint_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    s = open_store("s3://my-bucket/some/prefix/")
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix) == ("my-bucket", "some/prefix")
    assert s.endpoint_url == "http://127.0.0.1:2"  # the service-specific variable wins
    assert s.describe() == "s3://my-bucket/some/prefix/ at http://127.0.0.1:2"


def test_s3_explicit_endpoint_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:2")
    s = open_store("s3://bkt", endpoint_url="http://127.0.0.1:3")
    assert isinstance(s, S3Store)
    assert s.prefix == "" and s.endpoint_url == "http://127.0.0.1:3"


@pytest.mark.parametrize(
    "url", ["", "s3://", "s3:///prefix", "gs://b/p", "file://host/path", "s3://b/p?x=1"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        open_store(url)
    assert e.value.next_step
