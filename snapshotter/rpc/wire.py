"""What both ends of every call agree on outside the messages: the metadata keys a call
carries and the channel options. Its own module so that a client (every CLI call) does not
import the server and what the server needs (metrics, asyncio)."""

from __future__ import annotations

VERSION_KEY = "snapshotter-version"
PEER_KEY = "snapshotter-peer"
# The coordinator's fencing token, "EPOCH:ID" (agent/fencing.py).
FENCE_KEY = "snapshotter-fence"
MAX_MSG = 64 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MSG),
    ("grpc.max_receive_message_length", MAX_MSG),
]
