"""Pure GPU decisions: mapping a snapshot's GPUs onto a node's, per-process pairs, records."""

from __future__ import annotations

import pytest

from snapshotter import errors
from snapshotter.gpu.api import GpuInfo
from snapshotter.gpu.stage import rank_pairs, records_of, remap

pytestmark = pytest.mark.timeout(10)


def g(n: int, name: str = "NVIDIA H200", mem: int = 100) -> GpuInfo:
    return GpuInfo(f"GPU-0000000{n}-0000-0000-0000-000000000000", name, mem)


def test_same_gpus_stay_and_no_pairs() -> None:
    m = remap({0: [g(1)], 1: [g(2)]}, [g(1), g(2)])
    assert m == {g(1).uuid: g(1).uuid, g(2).uuid: g(2).uuid}
    assert rank_pairs([g(1)], m) is None


def test_other_gpus_of_same_type_are_paired_in_order() -> None:
    m = remap({0: [g(1)], 1: [g(2)]}, [g(5), g(6), g(7)])
    assert m == {g(1).uuid: g(5).uuid, g(2).uuid: g(6).uuid}
    assert rank_pairs([g(2)], m) == [(g(2).uuid, g(6).uuid)]


def test_ranks_sharing_a_gpu_still_share_one() -> None:
    m = remap({0: [g(1)], 1: [g(1)]}, [g(8), g(9)])
    assert m == {g(1).uuid: g(8).uuid}


def test_kept_gpu_is_not_given_to_another() -> None:
    m = remap({0: [g(1)], 1: [g(2)]}, [g(2), g(3)])
    assert m == {g(2).uuid: g(2).uuid, g(1).uuid: g(3).uuid}


def test_fewer_gpus_refused_with_cause_and_next_step() -> None:
    with pytest.raises(errors.GpuRemapRefused) as e:
        remap({0: [g(1)], 1: [g(2)]}, [g(5)])
    assert "2 x NVIDIA H200" in e.value.cause and "1 x NVIDIA H200" in e.value.cause
    assert "rank(s) [1]" in e.value.cause
    assert "thaw onto a node with 2 x NVIDIA H200" in e.value.next_step


def test_other_type_or_smaller_memory_refused() -> None:
    with pytest.raises(errors.GpuRemapRefused, match="NVIDIA A100"):
        remap({0: [g(1)]}, [g(5, "NVIDIA A100")])
    with pytest.raises(errors.GpuRemapRefused):
        remap({0: [g(1, mem=100)]}, [g(5, mem=80)])
    with pytest.raises(errors.GpuRemapRefused, match="no GPU"):
        remap({0: [g(1)]}, [])


def test_records_of_manifest_ranks() -> None:
    ranks = [
        {"rank": 0, "gpu": {"processes": 1, "gpus": [g(1).to_dict()]}},
        {"rank": 1},
        {"rank": 2, "gpu": {"processes": 0, "gpus": []}},
    ]
    assert records_of(ranks) == {0: [g(1)]}


def test_error_survives_the_wire() -> None:
    e = errors.GpuRemapRefused("cause", "next")
    back = errors.from_dict(e.to_dict())
    assert isinstance(back, errors.GpuRemapRefused) and back.exit_code == 11
    lt = errors.from_dict(errors.GpuLockTimeout("lock", 5, "CUDA_ERROR_TIMEOUT").to_dict())
    assert isinstance(lt, errors.GpuLockTimeout)
