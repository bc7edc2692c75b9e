"""The fake cuda.bindings.driver enforces the real state machine and error codes, and the real
driver code (`CudaDriver`) maps them to typed errors."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.gpu.api import ProcessState, uuid_bytes, uuid_str
from snapshotter.gpu.cuda import CudaDriver, detect, open_gpu_minors, parse_information
from snapshotter.testing.gpu_fake import CUresult, FakeCudaDriver, FakeGpu

pytestmark = pytest.mark.timeout(30)

H200 = [FakeGpu(bytes([0xA0] * 15 + [i]), "NVIDIA H200", 100) for i in range(2)]


@pytest.fixture()
def pid() -> Iterator[int]:
    # A real live process stands in for the CUDA process (the fake never touches it).
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield p.pid
    finally:
        p.kill()
        p.wait()


def test_full_cycle_and_states(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid, [1])
    d = CudaDriver(cu)
    assert d.get_state(pid) is ProcessState.RUNNING
    d.lock(pid, 1000)
    assert d.get_state(pid) is ProcessState.LOCKED
    d.checkpoint(pid)
    assert d.get_state(pid) is ProcessState.CHECKPOINTED
    d.restore(pid)
    assert d.get_state(pid) is ProcessState.LOCKED
    d.unlock(pid)
    assert d.get_state(pid) is ProcessState.RUNNING


@pytest.mark.parametrize(
    "op",
    ["checkpoint", "restore", "unlock"],
)
def test_misuse_from_running_is_illegal_state(pid: int, op: str) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid)
    d = CudaDriver(cu)
    with pytest.raises(errors.GpuDriverError) as e:
        getattr(d, op)(pid)
    assert e.value.result == "CUDA_ERROR_ILLEGAL_STATE"
    assert d.get_state(pid) is ProcessState.RUNNING


def test_double_lock_and_unlock_checkpointed(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid)
    d = CudaDriver(cu)
    d.lock(pid, 0)
    with pytest.raises(errors.GpuDriverError, match="ILLEGAL_STATE"):
        d.lock(pid, 0)
    d.checkpoint(pid)
    with pytest.raises(errors.GpuDriverError, match="ILLEGAL_STATE"):
        d.unlock(pid)
    assert d.get_state(pid) is ProcessState.CHECKPOINTED


def test_not_initialized_without_cuinit(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid)
    assert cu.cuCheckpointProcessGetState(pid)[0] == CUresult.CUDA_ERROR_NOT_INITIALIZED
    assert cu.cuDeviceGetCount()[0] == CUresult.CUDA_ERROR_NOT_INITIALIZED


def test_unknown_and_non_cuda_pids(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    d = CudaDriver(cu)
    with pytest.raises(errors.GpuDriverError) as e:
        d.get_state(pid)  # alive, no CUDA state
    assert e.value.result == "CUDA_ERROR_NOT_FOUND"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(errors.GpuDriverError) as e:
        d.lock(dead.pid, 10)
    assert e.value.result == "CUDA_ERROR_INVALID_VALUE"


def test_lock_timeout_is_typed_and_leaves_running(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid)
    cu.busy(pid)
    d = CudaDriver(cu)
    with pytest.raises(errors.GpuLockTimeout) as e:
        d.lock(pid, 50)
    assert e.value.result == "CUDA_ERROR_TIMEOUT"
    assert "keeps running" in e.value.next_step
    assert d.get_state(pid) is ProcessState.RUNNING


def test_injected_fault_keeps_state(pid: int) -> None:
    cu = FakeCudaDriver(list(H200))
    cu.add_process(pid)
    d = CudaDriver(cu)
    d.lock(pid, 0)
    cu.fail("checkpoint", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(errors.GpuDriverError) as e:
        d.checkpoint(pid)
    assert e.value.result == "CUDA_ERROR_OUT_OF_MEMORY"
    assert e.value.code == "gpu_driver_error" and e.value.exit_code == 11
    assert d.get_state(pid) is ProcessState.LOCKED


def test_restore_with_pairs_remaps_and_checks_type(pid: int) -> None:
    other = FakeGpu(bytes([0xB0] * 16), "NVIDIA A100", 100)
    cu = FakeCudaDriver([H200[1], other])
    cu.add_process(pid, [H200[0]])
    d = CudaDriver(cu)
    d.lock(pid, 0)
    d.checkpoint(pid)
    # Without pairs the old GPU is not on this node.
    with pytest.raises(errors.GpuDriverError, match="INVALID_DEVICE"):
        d.restore(pid)
    # A pair onto another chip type is refused.
    with pytest.raises(errors.GpuDriverError, match="INVALID_VALUE"):
        d.restore(pid, [(uuid_str(H200[0].uuid), uuid_str(other.uuid))])
    d.restore(pid, [(uuid_str(H200[0].uuid), uuid_str(H200[1].uuid))])
    assert cu.devices_of(pid) == [H200[1].uuid]
    d.unlock(pid)


def test_gpus_listing() -> None:
    d = CudaDriver(FakeCudaDriver(list(H200)))
    gs = d.gpus()
    assert [g.uuid for g in gs] == [uuid_str(g.uuid) for g in H200]
    assert gs[0].name == "NVIDIA H200" and gs[0].memory == 100
    assert uuid_bytes(gs[1].uuid) == H200[1].uuid


def test_detect_without_driver_is_none_with_one_line(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO)

    class NoDriver:
        cuCheckpointProcessLock = None  # noqa: N815

        def cuInit(self, flags: int) -> None:  # noqa: N802
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found ...')

    assert detect(NoDriver()) is None
    lines = [r.getMessage() for r in caplog.records if "GPU stage off" in r.getMessage()]
    assert len(lines) == 1 and "no usable NVIDIA driver" in lines[0]


def test_detect_here_never_crashes() -> None:
    # On a machine without the NVIDIA driver this is None; with one, a driver.
    d = detect()
    assert d is None or isinstance(d, CudaDriver)


def test_detect_with_fake_finds_it() -> None:
    assert isinstance(detect(FakeCudaDriver(list(H200))), CudaDriver)


def test_parse_information() -> None:
    text = (
        "Model: \t\t NVIDIA H200\nIRQ:   \t\t 123\n"
        "GPU UUID: \t GPU-0A1B2C3D-0000-1111-2222-333344445555\nDevice Minor: \t 3\n"
    )
    assert parse_information(text) == (3, "GPU-0a1b2c3d-0000-1111-2222-333344445555")
    assert parse_information("nothing") is None


def test_open_gpu_minors_reads_fd_links(tmp_path: Path) -> None:
    fd = tmp_path / "42" / "fd"
    fd.mkdir(parents=True)
    for i, target in enumerate(["/dev/nvidia3", "/dev/nvidiactl", "/dev/nvidia-uvm", "/x"]):
        os.symlink(target, fd / str(i))
    assert open_gpu_minors(42, tmp_path) == {3}
    assert open_gpu_minors(43, tmp_path) == set()
