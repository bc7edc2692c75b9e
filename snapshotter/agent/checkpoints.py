"""The agent's side of application checkpoints: upload what this node's ranks staged.

A rank files a request in its spool directory, `<spool>/<job>/<rank>/req-<id>.json`
(checkpoint/spool.py). This watcher looks only at the directories of ranks this agent runs,
claims each request by renaming it to `taken-<incarnation>-<id>.json` (a request a previous
agent incarnation claimed and never answered is claimed again), carries it out on its own
workers (checkpoint/upload.py) and answers with `res-<id>.json`. The rank's memory is read
through `/proc/<pid>/fd/<fd>`, and only for a memfd the checkpoint module named, held by a
process of that rank's sandbox: a rank cannot make the agent (root) read anything else. A
request for another store than the agent's is refused (the rank then uploads itself, with its
own credentials).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from snapshotter import procutil
from snapshotter.agent.runtime import JobTable, NodeJob, RankRuntime
from snapshotter.agent.weights import WeightsHub
from snapshotter.checkpoint import catalog, spool, upload
from snapshotter.errors import InvalidArgument, KeyUnavailable, PermissionDenied
from snapshotter.storage.api import ObjectStore
from snapshotter.storage.reader import SnapshotReader
from snapshotter.storage.sealing import Seal

log = logging.getLogger(__name__)
_SCAN_S = 0.05
_PRUNE_AFTER_S = 120.0
_MEMFD_PREFIX = f"/memfd:{spool.MEMFD_NAME}"


class CheckpointSpool:
    """Watches the spool directories of this node's ranks; `env()` tells ranks where."""

    def __init__(self, root: Path, store: ObjectStore, store_url: str, jobs: JobTable,
                 incarnation: str, workers: int = 2) -> None:  # fmt: skip
        self.root = root
        # A sealed checkpoint's streams, unsealed for the rank that loads it: in memory when
        # the node has /dev/shm (a part can be large, and is read once).
        shm = Path("/dev/shm")
        where = shm if shm.is_dir() else root.parent
        self.fetch_root = where / f"snapshotter-fetch-{incarnation}"
        self.store_url = store_url
        self._store = catalog.checkpoint_store(store)
        self._jobs = jobs
        self._incarnation = incarnation
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ckpt-upload")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # job -> its tenant's data key (memory only) and when it was handed (monotonic)
        self._keys: dict[str, tuple[Seal, float]] = {}
        # Weight push's ops go to it (agent/weights.py); None: refused.
        self.weights: WeightsHub | None = None
        self._lock = threading.Lock()
        self.handled = 0

    def hold_key(self, job_id: str, seal: Seal | None) -> None:
        """The data key the coordinator handed with a job's launch or restore here."""
        with self._lock:
            if seal is None:
                self._keys.pop(job_id, None)
            else:
                self._keys[job_id] = (seal, time.monotonic())

    def key_for(self, job: NodeJob) -> Seal | None:
        """What the job's checkpoints are sealed with here; None: plaintext.

        Raises:
            KeyUnavailable: the job is sealed but this agent holds no key for it.
        """
        with self._lock:
            seal, _ = self._keys.get(job.spec.job_id, (None, 0.0))
        if job.spec.sealed and seal is None:
            raise KeyUnavailable(
                f"job {job.spec.job_id} is sealed at rest, and this node agent holds no data key "
                "for it (it restarted since the job started here), so it stores no checkpoint",
                "freeze and thaw the job (the thaw hands its agents the key), or save to a "
                "store of your own with snapshotter.checkpoint.writer(url)",
            )
        return seal

    @property
    def enabled(self) -> bool:
        return bool(self.store_url)

    def env(self) -> dict[str, str]:
        if not self.enabled:
            return {}
        return {spool.SPOOL_ENV: str(self.root), spool.STORE_ENV: self.store_url}

    def start(self) -> None:
        if not self.enabled:
            return
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        self.fetch_root.mkdir(parents=True, exist_ok=True, mode=0o711)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="ckpt-spool")
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.fetch_root, ignore_errors=True)

    def prune(self, now: float | None = None) -> None:
        """Remove the spool directories and data keys of jobs that no longer run here
        (housekeeping): a thawed job's ranks make theirs again, and its restore hands the key
        again.

        A key is handed before its job is in the job table (a launch or a restore takes
        seconds: CRIU restores the ranks first), so a key is kept while its job is being
        launched or restored, and for _PRUNE_AFTER_S after it was handed whatever the table
        says: a job thawed onto this node lost its key to this prune once (its first save
        after the thaw then failed the job)."""
        live = set(self._jobs.running_ids()) | set(self._jobs.launching_ids())
        now = time.monotonic() if now is None else now
        with self._lock:
            for job_id in set(self._keys) - live:
                if now - self._keys[job_id][1] > _PRUNE_AFTER_S:
                    del self._keys[job_id]
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in os.listdir(self.fetch_root) if self.fetch_root.is_dir() else []:
            if name not in live:
                shutil.rmtree(self.fetch_root / name, ignore_errors=True)
        now = time.time()
        for name in names:
            try:
                idle = now - (self.root / name).stat().st_mtime
            except FileNotFoundError:
                continue
            # Not while a launch or thaw may be under way (its job is not in the table yet).
            if name not in live and idle > _PRUNE_AFTER_S:
                shutil.rmtree(self.root / name, ignore_errors=True)

    def _watch(self) -> None:
        while not self._stop.wait(_SCAN_S):
            try:
                self.scan()
            except Exception:  # noqa: BLE001 - the watcher must keep running
                log.exception("checkpoint spool scan failed")

    def scan(self) -> int:
        """Claim every waiting request of this node's live ranks; return how many."""
        claimed = 0
        for job in self._jobs.all():
            if job.state.terminal:
                continue
            for r in job.alive_ranks():
                d = self.root / job.spec.job_id / str(r.rank)
                try:
                    names = os.listdir(d)
                except FileNotFoundError:
                    continue
                for name in names:
                    rid = _claimable(name, self._incarnation)
                    if rid is None:
                        continue
                    taken = d / f"taken-{self._incarnation}-{rid}.json"
                    try:
                        os.rename(d / name, taken)
                    except FileNotFoundError:
                        continue  # the rank withdrew it
                    claimed += 1
                    self._pool.submit(self._serve, job, r, taken, d / f"res-{rid}.json")
        return claimed

    def _serve(self, job: NodeJob, r: RankRuntime, taken: Path, answer: Path) -> None:
        try:
            result = self._carry_out(job, r, _read_request(taken))
        except Exception as e:  # noqa: BLE001 - the rank must hear back whatever went wrong
            result = spool.failed(e)
        _write_answer(answer, result)
        taken.unlink(missing_ok=True)
        self.handled += 1

    def _carry_out(self, job: NodeJob, r: RankRuntime, request: spool.Request) -> dict[str, Any]:
        if request.op in spool.WEIGHT_OPS:
            if self.weights is None:
                raise InvalidArgument("this node agent moves no weights",
                                      "run the job under a snapshotter agent of this version")
            pids = procutil.sandbox_pids(r.sandbox.pid)
            return self.weights.handle(job.spec.job_id, job.spec.tenant, request,
                                       lambda fd: open_rank_memfd(pids, fd))  # fmt: skip
        if not spool.same_store(request.url, self.store_url):
            raise InvalidArgument(
                f"the node agent uploads checkpoints only to its own store, not {request.url}",
                "save to the agent's store, or let the rank upload itself",
            )
        pids = procutil.sandbox_pids(r.sandbox.pid)  # the rank first: parents come first
        seal = self.key_for(job)
        if request.op == "fetch":
            return self._fetch(job, r, request, seal)
        return upload.handle(self._store, request, lambda fd: open_rank_memfd(pids, fd), seal)

    def _fetch(self, job: NodeJob, r: RankRuntime, request: spool.Request,
               seal: Seal | None) -> dict[str, Any]:  # fmt: skip
        """A stream of a checkpoint, verified and unsealed with the job's own key (another
        tenant's sealed checkpoint does not open with it), for the rank to read."""
        started = time.monotonic()
        catalog.check_name(request.name)
        sid = request.name if request.stream == catalog.METADATA_STREAM else \
            catalog.part_id(request.name, request.index)  # fmt: skip
        dest = self.fetch_root / job.spec.job_id / str(r.rank) / request.id
        try:
            staged = SnapshotReader(self._store, sid, seal=seal).verify_and_fetch(
                dest, [request.stream])[request.stream]
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        size = staged.stat().st_size
        return {**spool.ok(size, size, 0, time.monotonic() - started), "path": str(staged)}


def _claimable(name: str, incarnation: str) -> str | None:
    """The request id in a spool file name this incarnation should take, else None."""
    if name.startswith("req-") and name.endswith(".json"):
        return name[4:-5]
    if name.startswith("taken-") and name.endswith(".json"):
        inc, _, rid = name[6:-5].partition("-")
        if inc != incarnation and rid:
            return rid  # claimed by an agent that died before it answered
    return None


def _read_request(path: Path) -> spool.Request:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
            if len(data) > spool.MAX_REQUEST_BYTES:
                break
    finally:
        os.close(fd)
    return spool.parse_request(data)


def _write_answer(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(result).encode())
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not answer checkpoint request %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def open_rank_memfd(pids: list[int], fd: int) -> int:
    """Open, for reading, the staging memfd `fd` of the first of `pids` that holds one by that
    number.

    Raises:
        PermissionDenied: no process of the rank holds a checkpoint memfd as `fd`.
    """
    for pid in pids:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            if not os.readlink(link).startswith(_MEMFD_PREFIX):
                continue
            opened = os.open(link, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        # The rank may have swapped the fd between the look and the open: look again at ours.
        if os.readlink(f"/proc/self/fd/{opened}").startswith(_MEMFD_PREFIX):
            return opened
        os.close(opened)
    raise PermissionDenied(
        f"fd {fd} of the rank is not a checkpoint staging buffer",
        "stage checkpoints with snapshotter.checkpoint.writer; do not close it mid-save",
    )
