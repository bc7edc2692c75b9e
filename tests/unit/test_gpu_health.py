"""The GPU fault watcher (snapshotter/gpu/health.py) against the NVML stand-in, which keeps
NVML's rules (init first, registered event types only, waits that time out), and the
coordinator's decision that a job must leave a node whose GPU failed."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from snapshotter.coordinator import detect
from snapshotter.gpu.health import FATAL_XIDS, GpuHealth, ecc_faults, fatal_xid, fault_proto
from snapshotter.testing.nvml_fake import FakeDevice, FakeNvml, UninitializedError


def _until(cond: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture()
def nvml() -> FakeNvml:
    return FakeNvml([FakeDevice("GPU-aaaa"), FakeDevice("GPU-bbbb", supported_events=0),
                     FakeDevice("GPU-cccc", ecc_enabled=False)])  # fmt: skip


@pytest.fixture()
def health(nvml: FakeNvml) -> Iterator[GpuHealth]:
    h = GpuHealth(nvml, poll_s=0.05).start()
    yield h
    h.stop()


def test_which_xids_mean_the_gpu_failed() -> None:
    assert fatal_xid(79) and fatal_xid(48) and fatal_xid(95) and fatal_xid(74)
    assert not fatal_xid(13) and not fatal_xid(31) and not fatal_xid(43)
    assert 13 not in FATAL_XIDS


def test_a_grown_uncorrected_count_is_a_fault() -> None:
    assert ecc_faults("g", 2, 2, 1.0) == [] and ecc_faults("g", None, 5, 1.0) == []
    assert ecc_faults("g", 5, 2, 1.0) == []  # a reset counter is no new error
    (f,) = ecc_faults("g", 2, 5, 1.0)
    assert (f.kind, f.code, f.fatal) == ("ecc", 3, True)


def test_the_stand_in_keeps_nvml_rules(nvml: FakeNvml) -> None:
    with pytest.raises(UninitializedError):
        nvml.device_get_count_v2()
    nvml.init_v2()
    s = nvml.event_set_create()
    with pytest.raises(nvml.NotSupportedError):  # device 1 delivers no events
        nvml.device_register_events(nvml.device_get_handle_by_index_v2(1), 1 << 1, s)
    with pytest.raises(nvml.TimeoutError):
        nvml.event_set_wait_v2(s, 10)
    with pytest.raises(nvml.InvalidArgumentError):
        nvml.device_get_handle_by_index_v2(3)
    nvml.shutdown()
    with pytest.raises(UninitializedError):
        nvml.event_set_create()


def test_xid_and_ecc_errors_are_reported_per_gpu(nvml: FakeNvml, health: GpuHealth) -> None:
    t0 = time.time()
    nvml.xid(0, 13)  # the job's own fault: seen, not fatal
    _until(lambda: health.faults(fatal_only=False))
    assert health.faults() == []
    nvml.xid(0, 79)  # fallen off the bus
    _until(health.faults)
    (f,) = health.faults()
    assert (f.uuid, f.kind, f.code, f.fatal) == ("GPU-aaaa", "xid", 79, True) and f.time >= t0
    nvml.ecc(1, 2)  # a device without events: its count is polled
    _until(lambda: len(health.faults()) == 2)
    assert health.faults()[1].uuid == "GPU-bbbb" and health.faults()[1].code == 2
    assert health.faults(since=time.time() + 1) == []
    assert fault_proto(f).detail == "XID 79 on GPU GPU-aaaa"


def test_stop_shuts_nvml_down(nvml: FakeNvml) -> None:
    h = GpuHealth(nvml, poll_s=0.05).start()
    h.stop()
    with pytest.raises(UninitializedError):
        nvml.device_get_count_v2()


def test_a_fatal_gpu_fault_moves_the_job_off_its_node(nvml: FakeNvml, health: GpuHealth) -> None:
    assert detect.gpu_failure({"a": [], "b": []}) is None
    nvml.xid(0, 13)
    _until(lambda: health.faults(fatal_only=False))
    seen = [fault_proto(f) for f in health.faults(fatal_only=False)]
    assert detect.gpu_failure({"a": seen}) is None  # not the GPU's fault
    nvml.xid(0, 48)
    _until(health.faults)
    fail = detect.gpu_failure({"a": [], "b": [fault_proto(f) for f in health.faults()]})
    assert fail is not None and fail.node == "b" and fail.cause == "gpu_error"
    assert "XID 48" in fail.detail
