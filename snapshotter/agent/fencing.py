"""Fencing tokens: only the newest coordinator may act on a node.

A coordinator takes a token `[epoch, id]` when it starts (epoch one past the last one recorded
in the object store, id random) and sends it with every call to an agent. The agent remembers
the highest token it has seen and refuses calls with a lower one, so a coordinator that was
replaced (a restart while the old one still runs, a network partition) can no longer freeze,
thaw or cancel anything once its successor has talked to the node. Two coordinators that read
the same epoch are ordered by id: exactly one of them wins on every node it reaches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from snapshotter import errors

Token = tuple[int, str]


def as_token(raw: Sequence[object] | str | None) -> Token | None:
    """A token from `[epoch, id]` or from the `snapshotter-fence` metadata "EPOCH:ID"."""
    if raw is None:
        return None
    parts: Sequence[object] = raw.split(":", 1) if isinstance(raw, str) else raw
    try:
        if len(parts) != 2:
            raise ValueError("needs two parts")
        return int(str(parts[0])), str(parts[1])
    except ValueError as e:
        raise errors.InvalidArgument(
            f"malformed fencing token {raw!r}: {e}", "upgrade the coordinator"
        ) from e


def admits(highest: Token | None, token: Token | None) -> bool:
    """Whether a call carrying `token` may act, given the highest token seen (pure)."""
    if highest is None:
        return True
    return token is not None and token >= highest


class Fence:
    """`on_newer` runs (outside the lock) whenever a newer coordinator shows up: what older
    ones left half-done can be undone at once instead of waiting for its lease."""

    def __init__(self, on_newer: Callable[[], None] | None = None) -> None:
        self._highest: Token | None = None
        self._lock = threading.Lock()
        self._on_newer = on_newer

    @property
    def highest(self) -> Token | None:
        with self._lock:
            return self._highest

    def check(self, raw: Sequence[object] | str | None) -> None:
        """Admit the call (raising the bar to its token) or raise Fenced."""
        token = as_token(raw)
        with self._lock:
            if not admits(self._highest, token):
                raise errors.Fenced(
                    f"this agent follows coordinator epoch {self._highest}; a call from "
                    f"{token if token is not None else 'an unfenced caller'} was refused",
                    "a newer coordinator has taken over: send requests to it",
                )
            newer = token is not None and (self._highest is None or token > self._highest)
            replaced = newer and self._highest is not None
            if newer:
                self._highest = token
        if replaced and self._on_newer is not None:
            self._on_newer()
