"""S3-compatible object storage (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...) via boto3.

Configured the AWS way: whatever is not passed explicitly comes from the standard environment
and AWS config files (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE,
AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, AWS_REGION / AWS_DEFAULT_REGION, AWS_MAX_ATTEMPTS, ...).
Objects are single PUTs: callers keep them bounded (one chunk), so there is no multipart upload
and nothing to abort. One boto3 client is shared by all threads (clients are thread-safe,
sessions are not, so the session is only used here, at construction).

Every botocore failure leaves this module as `StorageUnavailable` naming endpoint and bucket,
except "no such key", which is `ObjectMissing`. This module must never print or log
credentials.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from snapshotter.errors import StorageUnavailable
from snapshotter.storage.api import ObjectInfo, ObjectMissing, ObjectStore, check_key

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_MISSING_KEY_CODES = {"NoSuchKey", "404", "NotFound"}
_MISSING_BUCKET_CODES = {"NoSuchBucket"}
_DENIED_CODES = {
    "AccessDenied",
    "403",
    "Forbidden",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
}


@dataclass(frozen=True)
class S3Tuning:
    """Network behaviour of the S3 client. The defaults suit a datacenter object store."""

    # None: AWS_MAX_ATTEMPTS if set, else 5. Retry mode: AWS_RETRY_MODE if set, else
    # "standard" (backoff on throttling, 5xx and connection errors).
    max_attempts: int | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_pool_connections: int = 32  # at least the number of upload/download threads


class S3Store(ObjectStore):
    """Objects under `s3://<bucket>/<prefix>/` on any S3-compatible endpoint.

    Arguments left as None are resolved the AWS way (environment, then ~/.aws config).
    `addressing_style` defaults to "path" when a custom endpoint is configured (most
    S3-compatible servers need it) and to botocore's choice otherwise.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        addressing_style: str | None = None,
        tuning: S3Tuning = S3Tuning(),
    ) -> None:
        if not bucket:
            raise ValueError("S3Store needs a bucket name")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._client: Any = s3_client(
            endpoint_url=endpoint_url,
            region=region,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            addressing_style=addressing_style,
            tuning=tuning,
        )
        self.endpoint_url: str = self._client.meta.endpoint_url
        self._bucket_checked = False
        self._bucket_lock = threading.Lock()

    # -- naming ---------------------------------------------------------------------------

    def describe(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix + '/' if self.prefix else ''}"
        return f"{where} at {self.endpoint_url}"

    def _full(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    # -- operations -----------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        self._ensure_bucket()
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._unavailable("write", key, e) from e

    def get_bytes(self, key: str) -> bytes:
        full = self._full(key)
        self._ensure_bucket()
        attempts = 3  # botocore retries the request, but not a body cut off mid-read
        for attempt in range(attempts):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
                data: bytes = resp["Body"].read()
                return data
            except botocore.exceptions.ClientError as e:
                if _code(e) in _MISSING_KEY_CODES:
                    raise ObjectMissing(key, self.describe()) from e
                raise self._unavailable("read", key, e) from e
            except (
                botocore.exceptions.ResponseStreamingError,
                botocore.exceptions.IncompleteReadError,
                botocore.exceptions.ReadTimeoutError,
            ) as e:
                if attempt == attempts - 1:
                    raise self._unavailable("read", key, e) from e
            except botocore.exceptions.BotoCoreError as e:
                raise self._unavailable("read", key, e) from e
        raise AssertionError("unreachable")

    def head(self, key: str) -> int | None:
        full = self._full(key)
        self._ensure_bucket()
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=full)
        except botocore.exceptions.ClientError as e:
            if _code(e) in _MISSING_KEY_CODES:
                return None  # the bucket exists (checked above), so the key does not
            raise self._unavailable("stat", key, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._unavailable("stat", key, e) from e
        return int(resp["ContentLength"])

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        for page in self._pages(full, delimiter=None):
            for obj in page.get("Contents", []):
                yield self._rel(obj["Key"])

    def list_objects(self, prefix: str = "") -> Iterator[ObjectInfo]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        for page in self._pages(full, delimiter=None):
            for obj in page.get("Contents", []):
                # ListObjectsV2 carries size and time, so this costs no more than list_keys.
                yield ObjectInfo(
                    self._rel(obj["Key"]), int(obj["Size"]), obj["LastModified"].timestamp()
                )

    def list_dirs(self, prefix: str) -> Iterator[str]:
        if prefix and not prefix.endswith("/"):
            raise ValueError(f"list_dirs prefix must end with '/': {prefix!r}")
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        for page in self._pages(full, delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                yield cp["Prefix"][len(full) :].rstrip("/")

    def _pages(self, full_prefix: str, delimiter: str | None) -> Iterator[dict[str, Any]]:
        self._ensure_bucket()
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": full_prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        try:
            yield from self._client.get_paginator("list_objects_v2").paginate(**kwargs)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._unavailable("list", full_prefix, e) from e

    def delete_keys(self, keys: Iterable[str]) -> list[str]:
        full_keys = [self._full(k) for k in keys]
        if not full_keys:
            return []
        self._ensure_bucket()
        failed: list[str] = []
        for i in range(0, len(full_keys), _DELETE_BATCH):
            batch = full_keys[i : i + _DELETE_BATCH]
            try:
                resp = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
                raise self._unavailable("delete", batch[0], e) from e
            for err in resp.get("Errors", []):
                if err.get("Code") != "NoSuchKey":
                    failed.append(self._rel(err["Key"]))
        return failed

    # -- failures -------------------------------------------------------------------------

    def _ensure_bucket(self) -> None:
        """Check once that the bucket exists and is ours, so a 404 on a key means the key."""
        if self._bucket_checked:
            return
        with self._bucket_lock:
            if self._bucket_checked:
                return
            try:
                self._client.head_bucket(Bucket=self.bucket)
            except botocore.exceptions.ClientError as e:
                if _code(e) in _MISSING_KEY_CODES | _MISSING_BUCKET_CODES:
                    raise StorageUnavailable(
                        f"bucket {self.bucket!r} does not exist at {self.endpoint_url}",
                        f"create it (e.g. `aws s3 mb s3://{self.bucket} --endpoint-url "
                        f"{self.endpoint_url}`) or point the storage URL at an existing bucket",
                    ) from e
                raise self._unavailable("open bucket", "", e) from e
            except botocore.exceptions.BotoCoreError as e:
                raise self._unavailable("open bucket", "", e) from e
            self._bucket_checked = True

    def _unavailable(self, action: str, key: str, e: Exception) -> StorageUnavailable:
        what = f" {key!r}" if key else ""
        cause = f"cannot {action}{what} in {self.describe()}: {e}"
        if isinstance(e, botocore.exceptions.ClientError):
            code = _code(e)
            if code in _DENIED_CODES:
                return StorageUnavailable(
                    cause,
                    f"check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                    f"AWS_PROFILE) and that they may read and write bucket {self.bucket!r}",
                )
            if code in _MISSING_BUCKET_CODES:
                return StorageUnavailable(
                    cause, f"create bucket {self.bucket!r} or fix the storage URL"
                )
            return StorageUnavailable(
                cause, f"check the health of the object store at {self.endpoint_url}"
            )
        if isinstance(
            e, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError
        ):
            return StorageUnavailable(
                cause,
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for this process",
            )
        return StorageUnavailable(
            cause,
            f"check that the object store at {self.endpoint_url} is running and reachable from "
            "this node (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, firewall, DNS)",
        )


def s3_client(
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    access_key_id: str | None = None,
    secret_access_key: str | None = None,
    addressing_style: str | None = None,
    tuning: S3Tuning = S3Tuning(),
) -> Any:
    """A boto3 S3 client configured as `S3Store` uses it (arguments as there). Also for tools
    that must talk to the same store the same way (benchmarks); constructing it does no I/O.
    """
    endpoint_url = endpoint_url or _env_endpoint()
    region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    session = boto3.session.Session(
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        region_name=region,
    )
    if session.region_name is None and endpoint_url:
        region = "us-east-1"  # S3-compatible servers ignore it, but SigV4 needs one
    style = addressing_style or ("path" if endpoint_url else None)
    retries: Any = {
        "max_attempts": tuning.max_attempts or int(os.environ.get("AWS_MAX_ATTEMPTS", 5)),
        "mode": os.environ.get("AWS_RETRY_MODE", "standard"),
    }
    s3_opts: Any = {"addressing_style": style} if style else None
    config = botocore.config.Config(
        retries=retries,
        connect_timeout=tuning.connect_timeout_s,
        read_timeout=tuning.read_timeout_s,
        max_pool_connections=tuning.max_pool_connections,
        s3=s3_opts,
    )
    return session.client(
        "s3", endpoint_url=endpoint_url, region_name=region or None, config=config
    )


def _env_endpoint() -> str | None:
    if os.environ.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() == "true":
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))
