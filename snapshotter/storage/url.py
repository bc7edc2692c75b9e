"""Storage URLs: the one string a user gives to say where snapshots live.

    file:///var/lib/snapshotter      local directory (also: a plain path)
    s3://bucket                      S3 bucket root
    s3://bucket/some/prefix          S3 bucket, objects under some/prefix/

Everything else about S3 (endpoint, region, credentials, retries) comes the AWS way from the
environment and AWS config files, or from `open_store`'s keyword arguments. This module only
parses; it does no I/O beyond constructing the client.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from snapshotter.errors import InvalidArgument
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.local import LocalDirStore

if TYPE_CHECKING:
    from snapshotter.storage.s3 import S3Tuning

DEFAULT_LOCAL_ROOT = Path("/var/lib/snapshotter/store")


def open_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    region: str | None = None,
    tuning: S3Tuning | None = None,
) -> ObjectStore:
    """Return the backend a storage URL names.

    Raises:
        InvalidArgument: the URL has an unknown scheme or no bucket/path.
    """
    url = url.strip()
    if not url:
        raise InvalidArgument(
            "empty storage URL", f"use file://{DEFAULT_LOCAL_ROOT} or s3://bucket/prefix"
        )
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.lower()
    if scheme == "":
        return LocalDirStore(Path(url).expanduser())
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(
                f"file URL {url!r} names host {parsed.netloc!r}",
                "use file:///absolute/path (three slashes) for a local directory",
            )
        path = urllib.parse.unquote(parsed.path)
        if not path:
            raise InvalidArgument(f"file URL {url!r} has no path", "use file:///absolute/path")
        return LocalDirStore(path)
    if scheme == "s3":
        if not parsed.netloc:
            raise InvalidArgument(f"S3 URL {url!r} has no bucket", "use s3://bucket/prefix")
        if parsed.query or parsed.fragment:
            raise InvalidArgument(
                f"S3 URL {url!r} has a query or fragment",
                "configure the endpoint with AWS_ENDPOINT_URL_S3 or --endpoint-url",
            )
        # Here, not at the top: boto3 costs a CLI call that only lists local checkpoints
        # a third of a second of CPU.
        from snapshotter.storage.s3 import S3Store, S3Tuning

        return S3Store(
            parsed.netloc,
            urllib.parse.unquote(parsed.path).strip("/"),
            endpoint_url=endpoint_url,
            region=region,
            tuning=tuning or S3Tuning(),
        )
    raise InvalidArgument(
        f"unsupported storage URL scheme {parsed.scheme!r} in {url!r}",
        "use file:///path for a local directory or s3://bucket/prefix for object storage",
    )
