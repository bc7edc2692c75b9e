"""The GPU stage against the fake driver, with real process trees standing in for sandboxes:
an "init" whose child is the CUDA "rank", whose own child is a DataLoader-like worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from snapshotter import errors
from snapshotter.gpu.api import ProcessState
from snapshotter.gpu.cuda import CudaDriver
from snapshotter.gpu.stage import GpuStage, GpuStageSettings, sandbox_pids
from snapshotter.testing.gpu_fake import CUresult, FakeCudaDriver, FakeGpu

pytestmark = pytest.mark.timeout(60)

S = ProcessState
TREE = (
    "import subprocess, sys, time\n"
    "w = 'import subprocess,sys,time; subprocess.Popen([sys.executable,\"-c\",\"import time; "
    "time.sleep(120)\"]); time.sleep(120)'\n"
    "subprocess.Popen([sys.executable, '-c', w])\n"
    "time.sleep(120)\n"
)


class Tree:
    def __init__(self) -> None:
        self.init = subprocess.Popen([sys.executable, "-c", TREE], start_new_session=True)
        deadline = time.monotonic() + 20
        while len(sandbox_pids(self.init.pid)) < 2:
            assert time.monotonic() < deadline, "process tree did not start"
            time.sleep(0.02)
        self.rank, self.worker = sandbox_pids(self.init.pid)[:2]

    def kill(self) -> None:
        for pid in (self.worker, self.rank):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.init.kill()
        self.init.wait()


GPUS = [FakeGpu(bytes([0xA0] * 15 + [i]), "NVIDIA H200", 100) for i in range(4)]


@pytest.fixture()
def trees() -> Iterator[list[Tree]]:
    made: list[Tree] = []
    try:
        made.extend(Tree() for _ in range(4))
        yield made
    finally:
        for t in made:
            t.kill()


def node(trees: list[Tree], gpus: list[FakeGpu] = GPUS) -> tuple[FakeCudaDriver, GpuStage]:
    cu = FakeCudaDriver(list(gpus))
    for i, t in enumerate(trees):
        cu.add_process(t.rank, [i % len(gpus)])
    return cu, GpuStage(CudaDriver(cu), GpuStageSettings(lock_timeout_s=0.3, op_timeout_s=10))


def states(cu: FakeCudaDriver, trees: list[Tree]) -> list[object]:
    return [cu.state_of(t.rank) for t in trees]


RUNNING = FakeCudaDriver.CUprocessState.CU_PROCESS_STATE_RUNNING
LOCKED = FakeCudaDriver.CUprocessState.CU_PROCESS_STATE_LOCKED
CHECKPOINTED = FakeCudaDriver.CUprocessState.CU_PROCESS_STATE_CHECKPOINTED


def test_freeze_release_in_parallel_skips_non_cuda(trees: list[Tree]) -> None:
    cu, stage = node(trees)
    cu.delay["checkpoint"] = 0.4
    ranks = {i: t.init.pid for i, t in enumerate(trees)}
    t0 = time.monotonic()
    hold = stage.freeze(ranks)
    took = time.monotonic() - t0
    assert states(cu, trees) == [CHECKPOINTED] * 4
    assert cu.max_in_flight >= 4 and took < 1.2, (cu.max_in_flight, took)
    # Only the rank process of each tree: the worker has no CUDA state and is skipped.
    assert [[p.pid for p in hold.ranks[i].procs] for i in range(4)] == [[t.rank] for t in trees]
    rec = hold.ranks[1].record()
    assert rec["processes"] == 1 and rec["checkpoint_s"] >= 0.4
    assert len(rec["gpus"]) == 4  # the fake cannot say which: every GPU of the node
    stage.release(hold)
    assert states(cu, trees) == [RUNNING] * 4


def test_lock_timeout_unlocks_everyone_and_job_continues(trees: list[Tree]) -> None:
    cu, stage = node(trees)
    cu.busy(trees[2].rank)
    with pytest.raises(errors.GpuLockTimeout) as e:
        stage.freeze({i: t.init.pid for i, t in enumerate(trees)})
    assert e.value.pid == trees[2].rank and "keeps running" in e.value.next_step
    assert states(cu, trees) == [RUNNING] * 4
    unlocked = {pid for op, pid, res in cu.calls if op == "unlock" and res == "CUDA_SUCCESS"}
    assert unlocked == {trees[i].rank for i in (0, 1, 3)}
    assert not [c for c in cu.calls if c[0] == "checkpoint"]


def test_checkpoint_failure_restores_the_checkpointed(trees: list[Tree]) -> None:
    cu, stage = node(trees)
    cu.fail("checkpoint", CUresult.CUDA_ERROR_OUT_OF_MEMORY, pid=trees[1].rank)
    with pytest.raises(errors.GpuDriverError) as e:
        stage.freeze({i: t.init.pid for i, t in enumerate(trees)})
    assert e.value.result == "CUDA_ERROR_OUT_OF_MEMORY"
    assert states(cu, trees) == [RUNNING] * 4
    restored = {pid for op, pid, res in cu.calls if op == "restore" and res == "CUDA_SUCCESS"}
    assert restored == {trees[i].rank for i in (0, 2, 3)}


def test_freeze_refuses_a_process_not_running(trees: list[Tree]) -> None:
    cu, stage = node(trees)
    CudaDriver(cu).lock(trees[0].rank, 0)
    with pytest.raises(errors.GpuCheckpointError, match="LOCKED, not RUNNING"):
        stage.freeze({i: t.init.pid for i, t in enumerate(trees)})
    assert states(cu, trees)[1:] == [RUNNING] * 3


def thawed_node(trees: list[Tree], gpus: list[FakeGpu]) -> tuple[FakeCudaDriver, GpuStage]:
    """A node onto which the trees were 'restored': CUDA state CHECKPOINTED on old GPUs."""
    cu = FakeCudaDriver(list(gpus))
    for i, t in enumerate(trees):
        cu.add_process(t.rank, [GPUS[i]], state=CHECKPOINTED)
    return cu, GpuStage(CudaDriver(cu), GpuStageSettings(op_timeout_s=10))


def recorded(n: int) -> dict[int, list]:
    from snapshotter.gpu.api import GpuInfo, uuid_str

    return {i: [GpuInfo(uuid_str(GPUS[i].uuid), GPUS[i].name, GPUS[i].memory)] for i in range(n)}


def test_thaw_onto_other_gpus_of_same_type(trees: list[Tree]) -> None:
    other = [FakeGpu(bytes([0xC0] * 15 + [i]), "NVIDIA H200", 100) for i in range(4)]
    cu, stage = thawed_node(trees, other)
    rec = recorded(4)
    mapping = stage.plan(rec)
    out = stage.thaw({i: t.init.pid for i, t in enumerate(trees)}, rec, mapping)
    assert states(cu, trees) == [RUNNING] * 4
    assert [cu.devices_of(t.rank) for t in trees] == [[g.uuid] for g in other]
    assert out[0]["processes"] == 1


def test_thaw_restore_failure_leaves_nothing_locked(trees: list[Tree]) -> None:
    cu, stage = thawed_node(trees, GPUS)
    cu.fail("unlock", CUresult.CUDA_ERROR_UNKNOWN, pid=trees[3].rank)
    cu.fail("restore", CUresult.CUDA_ERROR_OUT_OF_MEMORY, pid=trees[1].rank)
    rec = recorded(4)
    with pytest.raises(errors.GpuDriverError):
        stage.thaw({i: t.init.pid for i, t in enumerate(trees)}, rec, stage.plan(rec))
    got = states(cu, trees)
    assert LOCKED not in got, got
    assert got[1] == CHECKPOINTED and got[0] == RUNNING and got[2] == RUNNING


def test_thaw_refused_before_touching_anything(trees: list[Tree]) -> None:
    cu, stage = thawed_node(trees, GPUS[:2])
    # GPUs 0 and 1 are here; 2 and 3 are not, and nothing is left to take them.
    with pytest.raises(errors.GpuRemapRefused) as e:
        stage.plan(recorded(4))
    assert "4 x NVIDIA H200" in e.value.cause and "2 x NVIDIA H200" in e.value.cause
    assert not [c for c in cu.calls if c[0] != "get_state"]
    assert states(cu, trees) == [CHECKPOINTED] * 4


def test_thaw_without_checkpointed_process_is_refused(trees: list[Tree]) -> None:
    cu = FakeCudaDriver(list(GPUS))  # the restored ranks have no CUDA state at all
    stage = GpuStage(CudaDriver(cu))
    with pytest.raises(errors.GpuCheckpointError, match="no process of its restored sandbox"):
        stage.thaw({0: trees[0].init.pid}, recorded(1), {})


def test_no_cuda_processes_is_a_no_op(trees: list[Tree]) -> None:
    stage = GpuStage(CudaDriver(FakeCudaDriver(list(GPUS))))
    hold = stage.freeze({i: t.init.pid for i, t in enumerate(trees)})
    assert hold.procs() == []
    stage.release(hold)
