"""The rank sandboxes this agent holds: turning a started or restored sandbox into a
RankRuntime, and the per-sandbox state on disk that must go when the sandbox does.

Per sandbox the agent keeps a record under <home>/sandboxes (so a restarted agent finds the
orphans of its previous incarnation, agent/orphans.py) and the init's working directory. The
RankRuntime owns both through its cleanups: the record goes when the sandbox ends, the
directory when the last live sandbox using it ends (a fork restored on the node where its
original runs shares the original's directory) and only if this agent made it.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from snapshotter.agent.logs import LogPump
from snapshotter.agent.orphans import forget, record
from snapshotter.agent.rankctl import RankChannel
from snapshotter.agent.runtime import RankRuntime
from snapshotter.config import Paths
from snapshotter.launch.env import RankPlacement
from snapshotter.sandbox.spawn import Sandbox


class Sandboxes:
    def __init__(self, paths: Paths) -> None:
        self.paths = paths
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

    def adopt(self, p: RankPlacement, sandbox: Sandbox, job_id: str, init_cwd: str) -> RankRuntime:
        """Hand a started or restored sandbox (its init dir reserved) to a RankRuntime, which
        owns both from now on."""
        record(self.registry, sandbox.pid)
        ctl_in, ctl_out, out, err = sandbox.io.take("ctl_in", "ctl_out", "stdout", "stderr")
        rt = RankRuntime(
            placement=p,
            sandbox=sandbox,
            channel=RankChannel(p.rank, ctl_in, ctl_out),
            pump=LogPump(self.paths.log_file(job_id, p.rank), [out, err]),
            init_cwd=init_cwd,
        )
        pid = sandbox.pid
        rt.cleanups.append(lambda: forget(self.registry, pid))
        rt.cleanups.append(lambda: self._release(init_cwd))
        return rt

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
