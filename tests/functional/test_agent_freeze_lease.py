"""The agent's own end of a freeze whose coordinator went quiet (its lease ran out) acts on the
job that freeze froze, never on another job that took the same id meanwhile (a recovery thaws
the job again on this node under its id while the old freeze's lease is still running)."""

from __future__ import annotations

from pathlib import Path

from snapshotter.agent.freeze import Freeze, FreezePhase, Freezes
from snapshotter.agent.runtime import JobTable, NodeJob, NodeJobState
from snapshotter.config import Paths
from snapshotter.launch.env import RdzvAddress
from snapshotter.launch.spec import JobSpec
from snapshotter.storage.local import LocalDirStore


def _job(table: JobTable) -> NodeJob:
    spec = JobSpec("job-a", "train.py", [], False, "python3", "/", {}, nnodes=2)
    job = NodeJob(spec=spec, node_rank=1, rdzv=None, remote_rdzv=RdzvAddress("10.0.0.1", 29500))
    table.begin_launch("job-a")
    table.end_launch("job-a", job)
    return job


def test_a_lapsed_freeze_leaves_the_job_thawed_again_under_its_id(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "home")
    jobs = JobTable("n1")
    freezes = Freezes("n1", paths, LocalDirStore(tmp_path / "store"), jobs, lambda: None,
                      lambda plane: {}, 2, lease_s=0.0)  # fmt: skip
    old = _job(jobs)
    assert old.op_lock.acquire(blocking=False)  # what the freeze's prepare took
    fr = Freeze("frz-1", "job-a", paths.work_dir("frz-1"), phase=FreezePhase.DUMPED, job=old)
    fr.work.mkdir(parents=True)
    freezes._freezes[fr.freeze_id] = fr  # a dump that the coordinator never finished
    # The coordinator gave the job up: its ranks here were ended, and the job was thawed on
    # this node again under its id; that thaw holds the new job's lock now.
    old.state = NodeJobState.CANCELLED
    new = _job(jobs)
    assert jobs.get("job-a") is new
    assert new.op_lock.acquire(blocking=False)

    freezes.check_leases()

    assert freezes.live_ids() == set()  # the lapsed freeze is over...
    assert not old.op_lock.locked() and not fr.work.exists()  # ...and released what it held
    assert new.op_lock.locked(), "the lease's recovery released the lock of another job"
    assert new.state is NodeJobState.RUNNING
