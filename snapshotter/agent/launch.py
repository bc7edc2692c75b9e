"""Launching a job's ranks on this node: all of them, or none.

Whatever fails (a spawn, a Cancel arriving meanwhile, the caller giving up on the call), every
sandbox started is killed and reaped, its pipes and records released, and the job's
rendezvous server stopped, before the error is raised: a failed launch leaves nothing running.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from snapshotter import errors
from snapshotter.agent.allow import ExecPolicy
from snapshotter.agent.rdzv import RdzvHost
from snapshotter.agent.runtime import JobTable, NodeJob
from snapshotter.agent.sandboxes import Sandboxes
from snapshotter.config import Paths
from snapshotter.launch.env import RdzvAddress, placements, rank_argv, rank_env
from snapshotter.launch.rootcause import error_file
from snapshotter.launch.spec import JobSpec
from snapshotter.rpc.server import caller_active
from snapshotter.sandbox.spawn import PRIVATE_TMP, spawn

log = logging.getLogger(__name__)


class Launcher:
    def __init__(
        self,
        node: str,
        paths: Paths,
        jobs: JobTable,
        sandboxes: Sandboxes,
        rdzv: RdzvHost,
        policy: ExecPolicy,
        node_env: Callable[[int], dict[str, str]],
        netns: str | None,
        private_tmp: bool,
    ) -> None:
        self.node = node
        self.paths = paths
        self.jobs = jobs
        self.sandboxes = sandboxes
        self.rdzv = rdzv
        self.policy = policy
        self.node_env = node_env
        self.netns = netns
        self.private_tmp = private_tmp

    def launch(
        self, spec: JobSpec, node_rank: int, rdzv_at: RdzvAddress | None, plane: int = 0
    ) -> NodeJob:
        """Start this node's ranks of `spec` (node `node_rank` of the job).

        Raises:
            PermissionDenied: the interpreter or working directory is not allowed here.
            InvalidArgument: the job already runs here.
            SandboxError: a rank could not be started.
            FreezeRefused / ServiceUnavailable: cancelled, or the caller gave up, meanwhile.
        """
        self.policy.check(spec, self.node)
        cancelled = self.jobs.begin_launch(spec.job_id)
        job: NodeJob | None = None
        try:
            server, remote = self.rdzv.claim(spec, rdzv_at)
            job = NodeJob(spec=spec, node_rank=node_rank, rdzv=server, remote_rdzv=remote,
                          plane=plane)  # fmt: skip
            self._start_ranks(job, cancelled)
        except BaseException as e:
            if job is not None:
                undo(job, e, self.node)
            self.jobs.end_launch(spec.job_id, None)
            raise
        self.jobs.end_launch(spec.job_id, job)
        job.watch()
        return job

    def _start_ranks(self, job: NodeJob, cancelled: threading.Event) -> None:
        spec = job.spec
        for p in placements(spec.nnodes, spec.nproc_per_node, job.node_rank):
            check_launch(spec.job_id, cancelled)
            init_cwd = self.paths.init_cwd(f"{spec.job_id}-r{p.rank}-{uuid.uuid4().hex[:8]}")
            env = rank_env(spec.env, p, job.rdzv_address, spec.job_id, self.node_env(job.plane),
                           error_file(spec.env, str(init_cwd)))  # fmt: skip
            argv = rank_argv(spec.python, spec.script, spec.script_args, spec.module)
            self.sandboxes.reserve(init_cwd)
            try:
                sb = spawn(
                    argv,
                    env,
                    spec.cwd,
                    init_cwd=init_cwd,
                    netns=self.netns,
                    private_tmp=PRIVATE_TMP if self.private_tmp else None,
                )
            except BaseException:
                self.sandboxes.release(init_cwd)  # made for a spawn that failed
                raise
            job.ranks.append(self.sandboxes.adopt(p, sb, job, str(init_cwd)))
        check_launch(spec.job_id, cancelled)


def check_launch(job_id: str, cancelled: threading.Event) -> None:
    """Raises if the launch (or restore) of `job_id` must stop: cancelled, or abandoned."""
    if cancelled.is_set():
        raise errors.FreezeRefused(
            f"the launch of job {job_id} was cancelled while it started its ranks",
            "nothing of it is left running; launch it again if that was not meant",
        )
    if not caller_active():
        raise errors.ServiceUnavailable(
            f"the caller gave up on the launch of job {job_id} (its deadline passed)",
            "nothing of it is left running; retry the launch",
        )


def undo(job: NodeJob, cause: BaseException, node: str) -> None:
    """End every rank a failed launch or restore started, and release what they hold (their
    watchers never ran: nobody else would)."""
    log.warning(
        "launch of job %s on node %s failed (%s); ending the %d rank(s) it started",
        job.spec.job_id, node, cause, len(job.ranks),
    )  # fmt: skip
    for r in job.ranks:
        r.sandbox.kill()
    for r in job.ranks:
        r.sandbox.wait(30)
    job.release()
