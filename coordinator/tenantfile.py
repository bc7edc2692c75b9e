"""A coordinator's per-tenant settings file (limits, webhooks): {"tenants": {T: {...}}}, read
again when it changes (so a CLI edit takes effect without a restart), written whole and
atomically (0600: it may hold secrets). Path None: kept in memory only (tests)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

from snapshotter import errors

T = TypeVar("T")


class TenantFile(Generic[T]):
    def __init__(self, path: Path | None, parse: Callable[[str, dict[str, Any]], T],
                 dump: Callable[[T], dict[str, Any]]) -> None:  # fmt: skip
        self.path = path
        self._parse = parse
        self._dump = dump
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._items: dict[str, T] = {}

    def all(self) -> dict[str, T]:
        with self._lock:
            if self.path is None:
                return dict(self._items)
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                self._items, self._mtime = {}, None
                return {}
            if mtime != self._mtime:
                self._items = self._read(self.path)
                self._mtime = mtime
            return dict(self._items)

    def _read(self, path: Path) -> dict[str, T]:
        try:
            body = json.loads(path.read_text() or "{}")
            return {str(t): self._parse(str(t), dict(d))
                    for t, d in (body.get("tenants") or {}).items()}  # fmt: skip
        except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
            raise errors.InvalidArgument(
                f"{path} is unreadable: {e}",
                "fix the file, or set it again with `snapshotter tenant`",
            ) from e

    def put(self, tenant: str, item: T | None) -> None:
        """Set (None: remove) one tenant's entry."""
        current = self.all()
        if item is None:
            current.pop(tenant, None)
        else:
            current[tenant] = item
        with self._lock:
            if self.path is None:
                self._items = current
                return
            body = {"tenants": {t: self._dump(x) for t, x in sorted(current.items())}}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(body, indent=1) + "\n")
            os.replace(tmp, self.path)
