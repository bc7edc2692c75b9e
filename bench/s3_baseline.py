"""Baseline: what plain boto3 gets out of an S3 endpoint, to judge snapshotter's upload/fetch.

One object of `total_bytes` incompressible bytes (os.urandom, made once and reused) is uploaded
with boto3's managed multipart upload (`upload_fileobj`, parts of `part_size` on `concurrency`
threads), downloaded again with `download_fileobj` into a sink that only counts, and deleted.
The client is the one `S3Store` uses (`snapshotter.storage.s3.s3_client`: same endpoint,
credentials, retries, connection pool), so the numbers compare like with like; botocore's
default request checksums are on, as they are for snapshotter's own PUTs.

Usage:
    python bench/s3_baseline.py [--size-mib 512] [--part-mib 8] [--concurrency 8]
        starts a private SeaweedFS (tests/support/seaweed.py) on 127.0.0.1 and measures it
    python bench/s3_baseline.py --bucket B ...
        measures an existing bucket; endpoint and credentials the AWS way (AWS_ENDPOINT_URL...)

Prints one JSON object. SeaweedFS here shares this machine's CPUs and disk with the client:
the numbers are a ceiling for snapshotter on the same setup, not a property of S3.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapshotter.storage.s3 import S3Tuning, s3_client  # noqa: E402

MiB = 1024 * 1024


class _CountingSink(io.RawIOBase):
    """A write-only, non-seekable file that keeps nothing: the download is measured, not the
    local disk (s3transfer then writes parts in order, buffering early ones)."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = len(memoryview(b))
        self.n += n
        return n


def boto3_multipart_throughput(
    client_kwargs: Mapping[str, Any],
    bucket: str,
    total_bytes: int,
    part_size: int,
    concurrency: int,
    data: bytes | None = None,
) -> dict[str, Any]:
    """Upload, download and delete one `total_bytes` object; return the rates in bytes/s.

    `client_kwargs` are `s3_client` keyword arguments (endpoint_url, region, access_key_id,
    secret_access_key, ...); empty means the AWS environment. `data` (exactly `total_bytes`)
    lets repeated calls reuse one buffer; by default it is made here.

    Raises:
        botocore errors as they come: a benchmark should stop on the first one.
    """
    if data is None:
        data = os.urandom(total_bytes)
    if len(data) != total_bytes:
        raise ValueError(f"data is {len(data)} bytes, not {total_bytes}")
    pool = max(concurrency + 2, S3Tuning.max_pool_connections)
    client = s3_client(**client_kwargs, tuning=S3Tuning(max_pool_connections=pool))
    config = TransferConfig(
        multipart_threshold=part_size,
        multipart_chunksize=part_size,
        max_concurrency=concurrency,
        use_threads=True,
    )
    key = f"bench/s3-baseline-{uuid.uuid4().hex}"
    try:
        t0 = time.perf_counter()
        client.upload_fileobj(io.BytesIO(data), bucket, key, Config=config)
        up_s = time.perf_counter() - t0
        stored = int(client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        if stored != total_bytes:
            raise RuntimeError(f"uploaded {total_bytes} bytes, the store holds {stored}")
        sink = _CountingSink()
        t0 = time.perf_counter()
        client.download_fileobj(bucket, key, sink, Config=config)
        down_s = time.perf_counter() - t0
        if sink.n != total_bytes:
            raise RuntimeError(f"downloaded {sink.n} bytes of {total_bytes}")
    finally:
        client.delete_object(Bucket=bucket, Key=key)
    return {
        "endpoint": client.meta.endpoint_url,
        "total_bytes": total_bytes,
        "part_size": part_size,
        "parts": -(-total_bytes // part_size),
        "concurrency": concurrency,
        "upload_s": round(up_s, 3),
        "upload_bytes_per_s": round(total_bytes / up_s),
        "download_s": round(down_s, 3),
        "download_bytes_per_s": round(total_bytes / down_s),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--part-mib", type=int, default=8, help="8 = snapshotter's chunk size")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1, help="repeat with the same data")
    ap.add_argument("--bucket", default=None, help="use this bucket and the AWS environment")
    args = ap.parse_args()
    total, part = args.size_mib * MiB, args.part_mib * MiB
    data = os.urandom(total)  # once: every round uploads the same bytes

    def measure(kwargs: Mapping[str, Any], bucket: str) -> list[dict[str, Any]]:
        return [
            boto3_multipart_throughput(kwargs, bucket, total, part, args.concurrency, data)
            for _ in range(args.rounds)
        ]

    if args.bucket:
        rounds = measure({}, args.bucket)
    else:
        from tests.support.seaweed import SeaweedServer

        with SeaweedServer() as server:
            rounds = measure(server.store_kwargs(), server.bucket)
    out = {
        **rounds[-1],
        "upload_MiB_per_s": [round(r["upload_bytes_per_s"] / MiB, 1) for r in rounds],
        "download_MiB_per_s": [round(r["download_bytes_per_s"] / MiB, 1) for r in rounds],
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
