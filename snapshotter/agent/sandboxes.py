"""The rank sandboxes this agent holds: turning a started or restored sandbox into a
RankRuntime, and the per-sandbox state on disk that must go when the sandbox does.

Per sandbox the agent keeps a record under <home>/sandboxes (so a restarted agent finds the
orphans of its previous incarnation, agent/orphans.py) and the init's working directory. The
RankRuntime owns both through its cleanups: the record goes when the sandbox ends, the
directory when the last live sandbox using it ends (a fork restored on the node where its
original runs shares the original's directory) and only if this agent made it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.agent.keeping import AdoptedSandbox, KeeperClient, meta_of
from snapshotter.agent.logs import KeptPump, LogPump
from snapshotter.agent.orphans import forget, record
from snapshotter.agent.rankctl import RankChannel
from snapshotter.agent.rdzv import RdzvServer
from snapshotter.agent.runtime import JobTable, NodeJob, RankRuntime
from snapshotter.config import Paths
from snapshotter.launch.env import RankPlacement, RdzvAddress
from snapshotter.launch.rootcause import error_file
from snapshotter.launch.spec import JobSpec
from snapshotter.sandbox.spawn import Sandbox

log = logging.getLogger(__name__)


class Sandboxes:
    def __init__(self, paths: Paths, keeper: KeeperClient | None = None) -> None:
        self.paths = paths
        self.keeper = keeper
        self.registry = paths.home / "sandboxes"
        self._lock = threading.Lock()
        # init dir -> (live ranks using it, made by this agent)
        self._init_cwds: dict[str, tuple[int, bool]] = {}

    def reserve(self, init_cwd: Path) -> None:
        """Count a use of `init_cwd` before a sandbox is started or restored in it (making it
        if missing), so no rank that ends meanwhile removes it under the restore. `adopt`
        takes the reservation over; `release` gives it back if the sandbox never came."""
        with self._lock:
            users, made = self._init_cwds.get(str(init_cwd), (0, False))
            made_now = not init_cwd.is_dir()
            init_cwd.mkdir(parents=True, exist_ok=True)
            self._init_cwds[str(init_cwd)] = (users + 1, made or made_now)

    def release(self, init_cwd: Path) -> None:
        self._release(str(init_cwd))

    def adopt(self, p: RankPlacement, sandbox: Sandbox, job: NodeJob, init_cwd: str) -> RankRuntime:
        """Hand a started or restored sandbox (its init dir reserved) to a RankRuntime, which
        owns both from now on. With a keeper, the keeper holds the pipes too and pumps the
        output: the rank outlives this agent process."""
        record(self.registry, sandbox.pid)
        ctl_in, ctl_out, out, err = sandbox.io.take("ctl_in", "ctl_out", "stdout", "stderr")
        log_path = self.paths.log_file(job.spec.job_id, p.rank)
        pid = sandbox.pid
        pump: LogPump | KeptPump
        if self.keeper is not None:
            key = f"{job.spec.job_id}/{p.rank}/{pid}"
            remote = job.remote_rdzv
            meta = meta_of(job.spec.to_dict(), job.node_rank, p, init_cwd,
                           (remote.host, remote.port) if remote else None, sandbox.io.inodes,
                           job.rdzv.address.port if job.rdzv is not None else None)  # fmt: skip
            log_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.keeper.hold(key, pid, meta, log_path, [out, err, ctl_in, ctl_out])
            finally:
                os.close(out)
                os.close(err)
            pump = KeptPump()
            keeper = self.keeper
            cleanup_key = key
        else:
            pump = LogPump(log_path, [out, err])
        rt = RankRuntime(
            placement=p,
            sandbox=sandbox,
            channel=RankChannel(p.rank, ctl_in, ctl_out),
            pump=pump,
            init_cwd=init_cwd,
            error_file=error_file(job.spec.env, init_cwd),
        )
        if self.keeper is not None:
            rt.cleanups.append(lambda: keeper.release(cleanup_key))
        rt.cleanups.append(lambda: forget(self.registry, pid))
        rt.cleanups.append(lambda: self._release(init_cwd))
        return rt

    def readopt(self, jobs: JobTable, host: str) -> list[str]:
        """Take back the sandboxes the keeper held for a previous incarnation of this agent;
        return the jobs re-adopted. Node 0 of a job starts a new rendezvous server for it on
        the old one's port (that ended with the old agent; the ranks of every node reach it at
        that address at their next resume)."""
        if self.keeper is None:
            return []
        by_job: dict[str, list[dict[str, Any]]] = {}
        for e in self.keeper.held():
            by_job.setdefault(e["meta"]["job"]["job_id"], []).append(e)
        adopted = []
        for job_id, entries in by_job.items():
            try:
                job = self._readopt_job(entries, host)
            except Exception as e:  # noqa: BLE001 - one job's trouble must not lose the others
                log.error("could not re-adopt job %s: %s", job_id, e)
                for ent in entries:
                    self.keeper.release(ent["key"])
                continue
            jobs.begin_launch(job_id)
            jobs.end_launch(job_id, job)
            job.watch()
            adopted.append(job_id)
        if adopted:
            log.warning("re-adopted job(s) %s from the keeper", ", ".join(sorted(adopted)))
        return adopted

    def _readopted_cleanups(self, key: str, pid: int, init_cwd: str) -> list[Callable[[], None]]:
        keeper = self.keeper
        assert keeper is not None
        return [lambda: keeper.release(key), lambda: forget(self.registry, pid),
                lambda: self._release(init_cwd)]  # fmt: skip

    def _readopt_job(self, entries: list[dict[str, Any]], host: str) -> NodeJob:
        assert self.keeper is not None
        meta0 = entries[0]["meta"]
        spec = JobSpec.from_dict(meta0["job"])
        node_rank = int(meta0["node_rank"])
        remote = meta0.get("remote_rdzv")
        server = _rdzv_again(spec, host, meta0.get("rdzv_port")) if remote is None else None
        address = RdzvAddress(remote[0], int(remote[1])) if remote else None
        job = NodeJob(spec=spec, node_rank=node_rank, rdzv=server, remote_rdzv=address)
        for e in sorted(entries, key=lambda x: x["meta"]["placement"]["rank"]):
            p = RankPlacement(**e["meta"]["placement"])
            init_cwd = str(e["meta"]["init_cwd"])
            self.reserve(Path(init_cwd))
            inodes = {str(k): int(v) for k, v in e["meta"].get("inodes", {}).items()}
            sb = AdoptedSandbox(int(e["pid"]), self.keeper, inodes, str(e.get("start") or ""))
            ctl_in, ctl_out = self.keeper.fetch(e["key"])
            rt = RankRuntime(placement=p, sandbox=sb, channel=RankChannel(p.rank, ctl_in, ctl_out),
                             pump=KeptPump(), init_cwd=init_cwd,
                             error_file=error_file(spec.env, init_cwd))  # fmt: skip
            rt.cleanups.extend(self._readopted_cleanups(str(e["key"]), sb.pid, init_cwd))
            job.ranks.append(rt)
        return job

    def in_use(self, init_cwd: str) -> bool:
        with self._lock:
            return init_cwd in self._init_cwds

    def _release(self, path: str) -> None:
        """One use less; the last one removes the directory if this agent made it."""
        with self._lock:
            users, made = self._init_cwds.pop(path, (1, False))
            if users > 1:
                self._init_cwds[path] = (users - 1, made)
                return
        if made:
            shutil.rmtree(path, ignore_errors=True)


def _rdzv_again(spec: JobSpec, host: str, port: int | None) -> RdzvServer:
    """Node 0's rendezvous server for a re-adopted job, on its old port when that is free."""
    if port:
        server = RdzvServer(spec.python, host, spec.env, port=int(port))
        try:
            _ = server.address
            return server
        except errors.ServiceUnavailable as e:
            log.warning("job %s: rendezvous port %s is taken (%s); the ranks of other "
                        "nodes find the new one only after a thaw", spec.job_id, port,
                        e.cause)  # fmt: skip
    return RdzvServer(spec.python, host, spec.env)
