"""Weight push: a trainer publishes versions of its weights; rollout replicas on other nodes
update theirs in place, by parameter name, between generation steps.

    # the trainer (every rank may call it; rank 0's copy is sent)
    from snapshotter import weights
    weights.publish(model, version=step, channel="policy")

    # a rollout replica (another job of the same tenant, any node)
    sub = weights.subscribe("policy")
    while True:
        sub.update(model)                  # the newest version held here, if newer; cheap
        rollout = generate(model)          # never mixes two versions
        rollout.version = sub.version

`publish` costs the trainer one copy of the weights into shared memory (the staging slots
of snapshotter.checkpoint, double-buffered) and returns; the node agent takes them from there.
The bytes then move agent to agent, not through the object store: each replica's agent pulls
from its parent in a binary tree of the nodes that take the version (the publisher's link
carries it about twice), falling back to the publisher when a parent fails, and pulls only
the tensors whose digest changed since the version it holds. The trainer never waits for a
replica. A replica's `update` copies from the version its agent already holds whole, so it
never waits for the network either; `wait` blocks for a newer one.

Channels belong to the tenant of the job that publishes: a replica sees only its own
tenant's channels. Both sides must run under snapshotter (`snapshotter run`): the agents move
the bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from snapshotter import errors
from snapshotter.checkpoint import spool
from snapshotter.checkpoint.staging import Stager
from snapshotter.hook.protocol import RESUMED_ENV
from snapshotter.weights.index import DTYPES, Entry, check_channel, parse_index

log = logging.getLogger(__name__)
CHANNEL_ENV = "SNAPSHOTTER_WEIGHTS_CHANNEL"
_NEEDS_AGENT = "run the job with `snapshotter run` (the node agents move the weights)"


def _channel(channel: str | None) -> str:
    name = channel or os.environ.get(CHANNEL_ENV) or os.environ.get("SNAPSHOTTER_JOB_ID", "")
    if not name:
        raise errors.InvalidArgument("no weights channel named",
                                     f"pass channel=..., or set {CHANNEL_ENV}")  # fmt: skip
    return check_channel(name)


def _agent_request(op: str, channel: str, extents: tuple[spool.Extent, ...] = (),
                   meta: Mapping[str, Any] | None = None) -> spool.Request:  # fmt: skip
    url = os.environ.get(spool.STORE_ENV, "")
    if spool.agent_spool(os.environ, url) is None:
        raise errors.InvalidArgument(
            "snapshotter.weights found no snapshotter node agent for this process", _NEEDS_AGENT
        )
    return spool.Request(op, spool.new_id(), url, channel, extents, meta=meta)


def _submit(request: spool.Request, timeout: float = 600.0) -> Mapping[str, Any]:
    return spool.raise_if_failed(spool._via_agent(request, timeout))


def state_of(obj: Any) -> dict[str, torch.Tensor]:
    """The named tensors of a module or a (flat) state dict."""
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, Mapping):
        raise errors.InvalidArgument(f"cannot take weights from a {type(obj).__name__}",
                                     "pass an nn.Module or a dict of tensors")  # fmt: skip
    out = {}
    for k, v in obj.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise errors.InvalidArgument(
                f"state dict entry {k!r} is not a tensor under a name",
                "pass a flat dict of name -> tensor (model.state_dict())",
            )
        local = getattr(v, "full_tensor", None)
        out[k] = local() if callable(local) else v  # a DTensor: gathered whole
    return out


def _dtype_name(t: torch.Tensor, name: str) -> str:
    d = str(t.dtype).removeprefix("torch.")
    if d not in DTYPES:
        raise errors.InvalidArgument(f"tensor {name!r} has dtype {d}, which is not sent",
                                     f"publish tensors of {', '.join(sorted(DTYPES))}")  # fmt: skip
    return d


class Publisher:
    """One channel's publisher: two staging slots and one hand-off to the agent at a time.

    A version staged while the previous one is still being handed off waits in the other
    slot; a newer one staged meanwhile replaces it (replicas want the newest, and the
    trainer never waits for a slot)."""

    def __init__(self, channel: str | None = None) -> None:
        self.channel = _channel(channel)
        self._stager = Stager(2)
        self._cond = threading.Condition()
        self._pending: tuple[spool.Request, Any] | None = None  # staged, not handed yet
        self._busy = False  # a hand-off in flight
        self._closed = False
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None
        self.published: int | None = None  # the newest version its agent took
        self.superseded = 0  # versions replaced by a newer one before their hand-off

    def publish(self, obj: Any, version: int) -> None:
        """Stage `obj`'s tensors (the one copy the trainer pays) and hand them to the node
        agent in the background. Raises the error of an earlier hand-off, if one failed.

        Raises: InvalidArgument (no agent, a bad name, dtype or version)."""
        self._raise_failed()
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise errors.InvalidArgument(f"weights version {version!r} is not a positive int",
                                         "publish versions counting up from 1")  # fmt: skip
        state = state_of(obj)
        if not state:
            raise errors.InvalidArgument("there are no tensors to publish",
                                         "publish a model or a non-empty state dict")  # fmt: skip
        meta = {"version": version, "tensors": [
            {"name": k, "dtype": _dtype_name(t, k), "shape": list(t.shape)}
            for k, t in state.items()]}  # fmt: skip
        request = _agent_request("publish", self.channel, meta=meta)  # fails early: no agent
        with self._cond:
            if self._pending is not None:  # superseded before its hand-off: free its slot
                self._stager.release(self._pending[1])
                self._pending = None
                self.superseded += 1
        tensors = list(self._stager.stage(dict(state)).values())
        slot = self._stager.slot_of(tensors)
        assert slot is not None
        extents = tuple(spool.Extent(slot.fd, t.data_ptr() - slot.base,
                                     t.numel() * t.element_size()) for t in tensors)  # fmt: skip
        request = dataclasses.replace(request, extents=extents)
        with self._cond:
            self._pending = (request, slot)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._hand_off, daemon=True, name=f"weights-publish-{self.channel}"
                )
                self._worker.start()
            self._cond.notify_all()

    def _hand_off(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                (request, slot), self._pending = self._pending, None
                self._busy = True
            error = None
            try:
                _submit(request)
            except BaseException as e:  # noqa: BLE001 - raised on the next publish or wait
                error = e
            finally:
                self._stager.release(slot)
            with self._cond:
                self._busy = False
                if error is None:
                    self.published = max(self.published or 0, int((request.meta or {})["version"]))
                else:
                    self._error = error
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the agent took the newest version published so far (or raise its
        error).

        Raises: StorageUnavailable if that took longer than `timeout`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending is None and not self._busy,
                                       timeout):  # fmt: skip
                raise errors.StorageUnavailable(
                    f"the node agent did not take the weights of {self.channel!r} in "
                    f"{timeout:.0f} s",
                    "check the agent with `snapshotter nodes`",
                )
        self._raise_failed()

    def _raise_failed(self) -> None:
        with self._cond:
            e, self._error = self._error, None
        if e is not None:
            raise e

    def close(self) -> None:
        self.wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._stager.close()


_publishers: dict[str, Publisher] = {}


def publish(model_or_state_dict: Any, version: int, channel: str | None = None) -> None:
    """Publish `version` of the weights on `channel` (default: $SNAPSHOTTER_WEIGHTS_CHANNEL,
    else the job's id). Call it on every rank: rank 0 publishes, the others return at once."""
    if os.environ.get("RANK", "0") != "0":
        return
    name = _channel(channel)
    pub = _publishers.get(name)
    if pub is None:
        pub = _publishers[name] = Publisher(name)
    pub.publish(model_or_state_dict, version)


def flush(channel: str | None = None, timeout: float | None = None) -> None:
    """Wait until the agent took every version this process published on `channel`."""
    pub = _publishers.get(_channel(channel))
    if pub is not None:
        pub.wait(timeout)


class Subscription:
    """A replica's view of a channel: the version its agent holds, and what it applied."""

    def __init__(
        self,
        channel: str | None = None,
        on_version: Callable[[int], None] | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.channel = _channel(channel)
        self._resumed = os.environ.get(RESUMED_ENV, "")
        self.dir = self._subscribe()
        self.version: int | None = None  # the version update() last applied
        self.lineage: str | None = None
        self._applied: dict[str, str] = {}  # name -> digest of what is in the target now
        self._stop = threading.Event()
        self._thread = None
        if on_version is not None:
            self._thread = threading.Thread(target=self._notify, args=(on_version, poll_s),
                                            daemon=True, name="weights-subscribe")  # fmt: skip
            self._thread.start()

    def latest(self) -> int | None:
        """The newest version this node's agent holds whole (None: none yet)."""
        cur = self._current()
        return int(cur["version"]) if cur else None

    def _follow_again(self) -> None:
        """After a thaw the rank runs under an agent that does not follow the channel for it
        (another node's, or this node's, which stopped when the job stopped for the freeze):
        subscribe again, once per resume. A failure is logged and tried at the next look."""
        resumed = os.environ.get(RESUMED_ENV, "")
        if resumed == self._resumed:
            return
        try:
            self.dir = self._subscribe()
        except errors.SnapshotterError as e:
            log.warning("could not follow %r again after a resume: %s", self.channel, e)
            return
        self._resumed = resumed

    def _subscribe(self) -> Path:
        """Have this node's agent follow the channel; the directory it keeps versions in."""
        answer = _submit(_agent_request("subscribe", self.channel), timeout=60)
        return Path(str(answer["dir"]))

    def _current(self) -> dict[str, Any] | None:
        self._follow_again()
        try:
            cur = json.loads((self.dir / "current").read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return cur if isinstance(cur, dict) else None

    def _is_new(self, cur: Mapping[str, Any] | None) -> bool:
        return cur is not None and (cur.get("lineage"), cur.get("version")) != (
            self.lineage,
            self.version,
        )

    def wait(self, newer_than: int | None = None, timeout: float | None = None) -> int:
        """Block until the agent holds a version newer than `newer_than` (default: the one
        applied); return it.

        Raises: StorageUnavailable on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            cur = self._current()
            if cur is not None and (int(cur["version"]) > newer_than if newer_than is not None
                                    else self._is_new(cur)):  # fmt: skip
                return int(cur["version"])
            if deadline is not None and time.monotonic() > deadline:
                raise errors.StorageUnavailable(
                    f"no newer weights on {self.channel!r} in {timeout:.0f} s",
                    "check that the trainer publishes and `snapshotter nodes`")  # fmt: skip
            time.sleep(0.02)

    def update(self, model_or_state_dict: Any, *, wait: bool = False,
               timeout: float | None = None) -> int | None:  # fmt: skip
        """Copy the newest version this node holds into the target in place, by name, if it
        is not the one applied; return its version (None: nothing newer). Only tensors whose
        digest differs from what was applied last are copied. Call it between generation
        steps: a step then runs wholly on one version.

        Raises: InvalidArgument if a name, shape or dtype does not match the target."""
        if wait:
            self.wait(timeout=timeout)
        for _ in range(5):  # the agent may replace `current` between the read and the open
            cur = self._current()
            if not self._is_new(cur):
                return None
            assert cur is not None
            try:
                index = parse_index(Path(cur["index"]).read_bytes())
                fd = os.open(cur["data"], os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                self._apply(fd, index.entries, state_of(model_or_state_dict))
            finally:
                os.close(fd)
            self.lineage, self.version = index.lineage, index.version
            return self.version
        return None

    def _apply(self, fd: int, entries: tuple[Entry, ...],
               target: dict[str, torch.Tensor]) -> None:  # fmt: skip
        missing = [e.name for e in entries if e.name not in target]
        if missing:
            raise errors.InvalidArgument(
                f"the published weights have {len(missing)} tensor(s) the target lacks, "
                f"e.g. {missing[0]!r}",
                "subscribe with the same model the trainer publishes",
            )
        size = max((e.offset + e.length for e in entries), default=0)
        if size == 0:
            return
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            buf = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
            src = None
            with torch.no_grad():
                for e in entries:
                    if e.digest and self._applied.get(e.name) == e.digest:
                        continue  # unchanged since the last update
                    dst = target[e.name]
                    if str(dst.dtype).removeprefix("torch.") != e.dtype or \
                            tuple(dst.shape) != e.shape:  # fmt: skip
                        raise errors.InvalidArgument(
                            f"tensor {e.name!r} is {e.dtype}{list(e.shape)} in the published "
                            f"weights and {dst.dtype}{list(dst.shape)} here",
                            "subscribe with the same model the trainer publishes",
                        )
                    src = buf[e.offset : e.offset + e.length].view(dst.dtype).view(dst.shape)
                    dst.copy_(src)
                    self._applied[e.name] = e.digest
            del buf, src
        finally:
            try:
                mm.close()
            except BufferError:
                pass  # a view still refers to it: the mapping goes with the last one

    def _notify(self, callback: Callable[[int], None], poll_s: float) -> None:
        seen = None
        while not self._stop.wait(poll_s):
            v = self.latest()
            if v is not None and v != seen:
                seen = v
                try:
                    callback(v)
                except Exception:  # noqa: BLE001 - the user's callback must not end this
                    log.exception("weights callback failed")

    def close(self) -> None:
        self._stop.set()


def subscribe(channel: str | None = None, *,
              on_version: Callable[[int], None] | None = None) -> Subscription:  # fmt: skip
    """Follow `channel`: this node's agent pulls each new version as it is published.
    `on_version(v)` (optional) is called from a thread when version v is held here; apply it
    with `update` at a point where the model is not in use."""
    return Subscription(channel, on_version)


__all__ = ["Publisher", "Subscription", "flush", "publish", "subscribe"]
