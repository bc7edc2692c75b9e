"""torch.distributed.checkpoint storage through snapshotter's store.

    writer = snapshotter.checkpoint.writer("s3://bucket/prefix")
    fut = dcp.async_save(state, storage_writer=writer)      # the stall: one copy to memory
    ...
    dcp.load(state, storage_reader=snapshotter.checkpoint.reader("s3://bucket/prefix"))

The writer is also DCP's stager (`AsyncStager`): `async_save` has it copy the state into a
shared-memory slot (staging.py), then each rank's `write_data` hands the slot's extents to its
node agent (spool.py), which chunks, dedups, compresses and uploads them as the rank's part;
the coordinator rank's `finish` commits the checkpoint once every part is committed
(catalog.py). Every item starts on a page of its part's stream, so an unchanged tensor dedups
against the previous checkpoint. The reader fetches and verifies the parts a rank needs, then
copies each requested region into the tensors DCP hands it.

A plain `dcp.save` works too (no staging: `write_data` copies into a scratch memfd first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import mmap
import os
import pickle
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from snapshotter.checkpoint import catalog, spool
from snapshotter.checkpoint.staging import Stager, local_tensor
from snapshotter.errors import InvalidArgument, KeyUnavailable
from snapshotter.storage.reader import SnapshotReader

log = logging.getLogger(__name__)


def resolve_url(url: str | None) -> str:
    """The store a checkpoint goes to: the URL given, else $SNAPSHOTTER_STORE, else the
    store of the node agent the job runs under."""
    chosen = url or os.environ.get("SNAPSHOTTER_STORE") or os.environ.get(spool.STORE_ENV)
    if not chosen:
        raise InvalidArgument(
            "no checkpoint store given",
            "pass a URL (file:///path or s3://bucket/prefix) or set SNAPSHOTTER_STORE",
        )
    return chosen


class _Scratch:
    """A memfd for what is not staged in a slot: pickled objects, and tensors of a plain
    `dcp.save`."""

    def __init__(self) -> None:
        self.fd = os.memfd_create(f"{spool.MEMFD_NAME}-scratch", os.MFD_CLOEXEC)
        self.at = 0

    def add(self, data: bytes | memoryview) -> spool.Extent:
        start = self.at
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self.fd, view, self.at)
            view = view[n:]
            self.at += n
        return spool.Extent(self.fd, start, self.at - start)

    def close(self) -> None:
        os.close(self.fd)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy().data)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise InvalidArgument(f"checkpoint names unknown dtype {name!r}",
                              "load it with the torch version that saved it")  # fmt: skip
    return dt


class SnapshotterWriter(StorageWriter):
    """DCP storage writer (and async stager) into a snapshotter store."""

    _synchronize_after_execute = False  # staging is synchronous: nothing to wait for later

    def __init__(self, url: str | None = None, *, slots: int = 2) -> None:
        super().__init__()
        self.url = resolve_url(url)
        self._stager = Stager(slots)
        self._requested: str | None = None
        self._name = ""
        self._last = ""  # the last checkpoint this writer took part in: the dedup seed
        self.is_coordinator = False

    # -- AsyncStager ----------------------------------------------------------------------

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._stager.stage(state_dict)

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        self._stager.close()

    # -- StorageWriter --------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._requested = catalog.check_name(str(checkpoint_id)) if checkpoint_id else None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        name = self._requested or catalog.new_name()
        return [dataclasses.replace(p, storage_data={"name": name, "index": i})
                for i, p in enumerate(plans)]  # fmt: skip

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        where = plan.storage_data
        name, index = str(where["name"]), int(where["index"])
        self._name = name
        slot = self._stager.slot_of(_planner_tensors(planner))
        scratch = _Scratch()
        fut: Future[list[WriteResult]] = Future()
        try:
            extents: list[spool.Extent] = []
            described: list[dict[str, Any]] = []
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    extents.append(scratch.add(data.getbuffer()))
                    described.append({})
                    continue
                assert isinstance(data, torch.Tensor)
                t = local_tensor(data).detach()
                n = t.numel() * t.element_size()
                if slot is not None and slot.holds(t) and t.is_contiguous():
                    extents.append(spool.Extent(slot.fd, t.data_ptr() - slot.base, n))
                else:
                    extents.append(scratch.add(_tensor_bytes(t)))
                described.append({"dtype": str(t.dtype), "shape": list(t.shape)})
            offsets = catalog.layout([e.length for e in extents])
            results = [
                WriteResult(index=item.index, size_in_bytes=e.length,
                            storage_data={"part": index, "offset": o, "length": e.length, **d})
                for item, e, o, d in zip(plan.items, extents, offsets, described, strict=True)
            ]  # fmt: skip
            seed = catalog.part_id(self._last, index) if self._last else ""
            spool.submit(spool.Request("part", spool.new_id(), self.url, name, tuple(extents),
                                       index=index, seed=seed))  # fmt: skip
            self._last = name
            fut.set_result(results)
        except BaseException as e:  # noqa: BLE001 - DCP takes the failure from the future
            fut.set_exception(e)  # type: ignore[arg-type]  # torch's stub is wrong
        finally:
            scratch.close()
            if slot is not None:
                self._stager.release(slot)
            elif (oldest := self._stager.oldest_busy()) is not None:
                # A custom planner hid the state dict: saves finish in the order they staged.
                self._stager.release(oldest)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = StorageMeta(checkpoint_id=self._name)
        scratch = _Scratch()
        try:
            extent = scratch.add(pickle.dumps(metadata))
            parts = tuple(catalog.part_id(self._name, i) for i in range(len(results)))
            spool.submit(spool.Request("commit", spool.new_id(), self.url, self._name, (extent,),
                                       parts=parts, meta={"ranks": len(results)}))  # fmt: skip
        finally:
            scratch.close()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._name) if self._name else None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            catalog.check_name(str(checkpoint_id))
        except InvalidArgument:
            return False
        return True


def _planner_tensors(planner: SavePlanner) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for v in (getattr(planner, "state_dict", None) or {}).values():
        if isinstance(v, torch.Tensor):
            found.append(local_tensor(v))
            if len(found) >= 4:
                break
    return found


class SnapshotterReader(StorageReader):
    """DCP storage reader from a snapshotter store: a named checkpoint, or the newest."""

    def __init__(self, url: str | None = None, *, checkpoint_id: str | None = None) -> None:
        super().__init__()
        self.url = resolve_url(url)
        self._requested = catalog.check_name(checkpoint_id) if checkpoint_id else None
        self.name = ""
        self.storage_data: dict[MetadataIndex, Any] = {}
        self._store = catalog.checkpoint_store(self.url)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self._requested = catalog.check_name(str(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.name = self._requested or catalog.latest(self._store)
        catalog.read(self._store, self.name)
        with self._fetched(catalog.METADATA_STREAM, 0) as staged:
            metadata = pickle.loads(staged.read_bytes())
        if not isinstance(metadata, Metadata):
            raise InvalidArgument(f"checkpoint {self.name!r} holds no DCP metadata",
                                  "load it with the tool that wrote it")  # fmt: skip
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:  # fmt: skip
        self.storage_data = dict(metadata.storage_data or {})
        if not self.name and metadata.storage_meta is not None:
            self.name = str(metadata.storage_meta.checkpoint_id or "")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank must read the checkpoint the coordinator read, even if a newer one was
        # committed while the ranks looked for the newest.
        return [dataclasses.replace(p, storage_data=self.name) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if plan.storage_data and plan.storage_data != self.name:
            raise InvalidArgument(
                f"ranks found different newest checkpoints ({plan.storage_data!r} and "
                f"{self.name!r}): one was committed while they loaded",
                "load with checkpoint_id= to name the checkpoint",
            )
        by_part: dict[int, list[Any]] = defaultdict(list)
        for item in plan.items:
            by_part[int(self.storage_data[item.storage_index]["part"])].append(item)
        for index, items in sorted(by_part.items()):
            with self._fetched(catalog.DATA_STREAM, index) as staged:
                _load_items(staged, items, self.storage_data, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return SnapshotterWriter.validate_checkpoint_id(checkpoint_id)

    @contextlib.contextmanager
    def _fetched(self, stream: str, index: int) -> Iterator[Path]:
        """One stream of the checkpoint (its metadata, or part `index`'s data), verified,
        as a file that is removed on leaving. A sealed checkpoint is opened by the node agent
        with the job's own data key: the rank never holds it."""
        sid = self.name if stream == catalog.METADATA_STREAM else \
            catalog.part_id(self.name, index)  # fmt: skip
        sealed = catalog.read_manifest(self._store, sid).sealed
        if sealed is None:
            with _staging_dir() as tmp:
                yield SnapshotReader(self._store, sid).verify_and_fetch(tmp, [stream])[stream]
            return
        if spool.agent_spool(os.environ, self.url) is None:
            raise KeyUnavailable(
                f"checkpoint {self.name!r} is sealed under tenant {sealed.tenant!r}'s data key",
                "load it from a job of that tenant running under snapshotter: its node agent "
                "opens it",
            )
        res = spool.submit(spool.Request("fetch", spool.new_id(), self.url, self.name, (),
                                         index=index, stream=stream))  # fmt: skip
        path = Path(str(res.get("path", "")))
        try:
            yield path
        finally:
            shutil.rmtree(path.parent, ignore_errors=True)


def _load_items(path: Path, items: list[Any], storage_data: dict[MetadataIndex, Any],
                planner: LoadPlanner) -> None:  # fmt: skip
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size == 0:
            mm: mmap.mmap | bytes = b""
        else:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
        try:
            for item in items:
                sd = storage_data[item.storage_index]
                off, n = int(sd["offset"]), int(sd["length"])
                if off + n > size:
                    raise InvalidArgument(
                        f"item {item.storage_index.fqn} lies beyond its part ({off + n} > {size})",
                        "the checkpoint's metadata does not match its data; save it again",
                    )
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(bytes(mm[off:off + n])))
                    continue
                dtype = _dtype(sd["dtype"])
                if n == 0:
                    src = torch.empty(sd["shape"], dtype=dtype)
                else:
                    raw = torch.frombuffer(bytearray(mm[off:off + n]), dtype=torch.uint8)
                    src = raw.view(dtype).reshape(sd["shape"])
                for dim, (start, length) in enumerate(
                        zip(item.storage_offsets, item.lengths, strict=True)):
                    src = src.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                target.copy_(src)
                planner.commit_tensor(item, target)
        finally:
            if isinstance(mm, mmap.mmap):
                mm.close()


def _staging_dir() -> tempfile.TemporaryDirectory[str]:
    """A private temporary directory for fetched parts, in memory when /dev/shm is there."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix="snapshotter-load-", dir=base)
