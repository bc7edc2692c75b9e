"""Webhooks: a tenant's job events POSTed to the tenant's endpoint, signed, retried.

    $SNAPSHOTTER_HOME/webhooks.json (0600)
    {"tenants": {"acme": {"url": "https://hooks.acme.example/snapshotter", "secret": "..."}}}

`snapshotter tenant webhook T --url URL` sets it (and prints the secret once); the coordinator
re-reads the file when it changes. Every event the coordinator records for a job (JobEvent:
snapshot, snapshot_failed, failure, recovered, recovery_failed, gave_up, preempted, policy) is
sent as

    POST URL    Content-Type: application/json
                X-Snapshotter-Id: <uuid>      (the same on every retry of one delivery)
                X-Snapshotter-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "t.body")>
    {"id": <uuid>, "time": s, "tenant": T, "job_id": J, "event": {JobEvent as JSON}}

A delivery is retried (RETRY_DELAYS_S) while the endpoint fails or answers other than 2xx, then
dropped with a log line; deliveries wait in a bounded queue (the oldest dropped past
MAX_QUEUED), never on the coordinator's own path. Receivers check with `verify`: the
signature, the timestamp within a tolerance, and the id not seen before (a replay). The URL
must be https, or http to a loopback address (tests, a local relay).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Mapping, MutableSet
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from snapshotter import errors
from snapshotter.coordinator.tenantfile import TenantFile
from snapshotter.v1 import coordinator_pb2

log = logging.getLogger(__name__)
SIGNATURE = "X-Snapshotter-Signature"
DELIVERY_ID = "X-Snapshotter-Id"
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0)
MAX_QUEUED = 1000
TOLERANCE_S = 300.0


@dataclass(frozen=True)
class Endpoint:
    url: str
    secret: str


def check_url(url: str) -> str:
    """Raises InvalidArgument for a URL webhooks may not go to."""
    u = urllib.parse.urlsplit(url)
    host = u.hostname or ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if u.scheme == "https" and host or u.scheme == "http" and loopback:
        return url
    raise errors.InvalidArgument(
        f"webhook URL {url!r} is not https (plain http only to a loopback address)",
        "give an https:// URL",
    )


def sign(secret: str, body: bytes, at: float) -> str:
    t = int(at)
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


class WebhookRejected(ValueError):
    """A delivery a receiver must not act on: forged, stale or replayed."""


def verify(
    secret: str, headers: Mapping[str, str], body: bytes, seen: MutableSet[str],
    now: float | None = None, tolerance_s: float = TOLERANCE_S,
) -> dict[str, object]:  # fmt: skip
    """What a receiver does with a delivery: the payload, once, if it is genuine and fresh.
    `seen`: the delivery ids taken so far (kept at least `tolerance_s`). Raises
    WebhookRejected."""
    h = {k.lower(): v for k, v in headers.items()}
    parts = dict(p.split("=", 1) for p in h.get(SIGNATURE.lower(), "").split(",") if "=" in p)
    try:
        t = int(parts["t"])
    except (KeyError, ValueError) as e:
        raise WebhookRejected("no signature timestamp") from e
    if not hmac.compare_digest(sign(secret, body, t), f"t={t},v1={parts.get('v1', '')}"):
        raise WebhookRejected("the signature does not match (forged, or another secret)")
    now = time.time() if now is None else now
    if abs(now - t) > tolerance_s:
        raise WebhookRejected(f"signed {now - t:.0f}s ago, beyond {tolerance_s:.0f}s (replayed?)")
    payload = json.loads(body)
    ident = str(payload.get("id", ""))
    if not ident or ident != h.get(DELIVERY_ID.lower()) or ident in seen:
        raise WebhookRejected(f"delivery {ident!r} was taken already (a replay)")
    seen.add(ident)
    return dict(payload)


class WebhookConfig:
    """The webhooks file of one coordinator (None: in memory only)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file = TenantFile(
            path, lambda t, d: Endpoint(check_url(str(d["url"])), str(d["secret"])),
            lambda e: {"url": e.url, "secret": e.secret},
        )  # fmt: skip

    def get(self, tenant: str) -> Endpoint | None:
        return self._file.all().get(tenant)

    def all(self) -> dict[str, Endpoint]:
        return dict(self._file.all())

    def set(self, tenant: str, url: str | None) -> str | None:
        """Point `tenant`'s webhooks at `url` (None: none); returns the new secret."""
        if url is None:
            self._file.put(tenant, None)
            return None
        secret = secrets.token_urlsafe(32)
        self._file.put(tenant, Endpoint(check_url(url), secret))
        return secret


@dataclass
class _Delivery:
    endpoint: Endpoint
    ident: str
    body: bytes
    attempt: int = 0
    due: float = 0.0


Post = Callable[[str, bytes, Mapping[str, str]], int]


def _post(url: str, body: bytes, headers: Mapping[str, str]) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers=dict(headers))
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


class Webhooks:
    """Sends job events to their tenants' endpoints from one background thread."""

    def __init__(self, config: WebhookConfig, post: Post = _post) -> None:
        self.config = config
        self._post = post
        self._cv = threading.Condition()
        self._queue: collections.deque[_Delivery] = collections.deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.delivered = 0
        self.dropped = 0

    def emit(self, tenant: str, job_id: str, ev: coordinator_pb2.JobEvent) -> None:
        endpoint = self.config.get(tenant)
        if endpoint is None:
            return
        ident = str(uuid.uuid4())
        event = json_format.MessageToDict(ev, preserving_proto_field_name=True)
        payload = {"id": ident, "time": time.time(), "tenant": tenant, "job_id": job_id,
                   "event": event}  # fmt: skip
        body = json.dumps(payload, sort_keys=True).encode()
        with self._cv:
            if len(self._queue) >= MAX_QUEUED:
                self._queue.popleft()
                self.dropped += 1
                log.warning("webhook queue full: the oldest delivery was dropped")
            self._queue.append(_Delivery(endpoint, ident, body))
            self._start_locked()
            self._cv.notify()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._ready():
                    wait = min((d.due for d in self._queue), default=None)
                    self._cv.wait(None if wait is None else max(0.0, wait - time.monotonic()))
                if self._stop:
                    return
                d = self._ready()
                assert d is not None
                self._queue.remove(d)
            self._attempt(d)

    def _ready(self) -> _Delivery | None:
        now = time.monotonic()
        return next((d for d in self._queue if d.due <= now), None)

    def _attempt(self, d: _Delivery) -> None:
        headers = {"Content-Type": "application/json", DELIVERY_ID: d.ident,
                   SIGNATURE: sign(d.endpoint.secret, d.body, time.time())}  # fmt: skip
        try:
            status = self._post(d.endpoint.url, d.body, headers)
            why = "" if 200 <= status < 300 else f"HTTP {status}"
        except (OSError, ValueError) as e:
            why = str(e)
        if not why:
            self.delivered += 1
            return
        if d.attempt >= len(RETRY_DELAYS_S):
            self.dropped += 1
            log.warning("webhook %s to %s dropped after %d tries: %s", d.ident, d.endpoint.url,
                        d.attempt + 1, why)  # fmt: skip
            return
        d.due = time.monotonic() + RETRY_DELAYS_S[d.attempt]
        d.attempt += 1
        with self._cv:
            self._queue.append(d)
            self._cv.notify()
