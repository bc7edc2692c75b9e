"""The coordinator's fencing token, taken from the object store at start.

The store is the one thing every coordinator of a deployment shares, so it records the last
epoch handed out; a new coordinator takes the next one. Agents then refuse calls from any
older coordinator (snapshotter/agent/fencing.py), so after a restart, or with a second
coordinator started by mistake, only the newest one acts.
"""

from __future__ import annotations

import json
import secrets

from snapshotter.storage.api import ObjectMissing, ObjectStore

EPOCH_KEY = "control/coordinator-epoch"


def next_epoch(recorded: bytes | None) -> int:
    """The epoch after the recorded one (pure; a garbled record restarts above zero)."""
    if recorded is None:
        return 1
    try:
        return int(json.loads(recorded)["epoch"]) + 1
    except (ValueError, KeyError, TypeError):
        return 1


def take_token(store: ObjectStore) -> tuple[int, str]:
    """Record and return this coordinator's token `(epoch, id)`.

    Raises:
        StorageUnavailable: the store could not be read or written.
    """
    try:
        recorded: bytes | None = store.get_bytes(EPOCH_KEY)
    except ObjectMissing:
        recorded = None
    epoch = next_epoch(recorded)
    ident = secrets.token_hex(4)
    store.put_bytes(EPOCH_KEY, json.dumps({"epoch": epoch, "id": ident}).encode())
    return epoch, ident
