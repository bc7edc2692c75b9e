"""Fencing tokens and the coordinator epoch: pure decisions, no processes."""

from __future__ import annotations

import json

import pytest

from snapshotter import errors
from snapshotter.agent.fencing import Fence, admits
from snapshotter.agent.netenv import node_network_env
from snapshotter.coordinator.epoch import next_epoch
from snapshotter.coordinator.freeze import lost_text


def test_admits_only_the_newest_token() -> None:
    assert admits(None, None) and admits(None, (1, "a"))
    assert admits((2, "a"), (2, "a")) and admits((2, "a"), (3, "0"))
    assert not admits((2, "b"), (2, "a"))  # same epoch: the id orders them
    assert not admits((2, "a"), (1, "z"))
    assert not admits((1, "a"), None)  # once fenced, an unfenced caller is refused


def test_fence_raises_the_bar_and_tells_of_a_newer_coordinator() -> None:
    newer: list[bool] = []
    f = Fence(on_newer=lambda: newer.append(True))
    f.check([1, "a"])
    assert newer == []  # the first token seen replaces nobody
    f.check([1, "a"])
    f.check([2, "b"])
    assert f.highest == (2, "b") and newer == [True]
    with pytest.raises(errors.Fenced) as e:
        f.check([1, "a"])
    assert e.value.exit_code == 12 and "newer coordinator" in e.value.next_step
    with pytest.raises(errors.InvalidArgument):
        f.check([3])


def test_next_epoch_survives_missing_or_garbled_records() -> None:
    assert next_epoch(None) == 1
    assert next_epoch(json.dumps({"epoch": 41, "id": "x"}).encode()) == 42
    assert next_epoch(b"not json") == 1
    assert next_epoch(b'{"id": "x"}') == 1


def test_node_network_env_names_the_interface_and_explicit_values_win() -> None:
    env = node_network_env("eth7", {"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"})
    assert env == {
        "GLOO_SOCKET_IFNAME": "eth7",
        "TP_SOCKET_IFNAME": "eth7",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5_0",
    }
    assert node_network_env(None, {}) == {}


def test_lost_text_names_silent_and_ended_nodes() -> None:
    assert lost_text(["b"], []) == "node(s) b do not answer"
    assert lost_text(["b"], ["a", "c"]) == (
        "node(s) b do not answer; the ranks on node(s) a, c ended"
    )
    assert lost_text([], []) == ""
    # A switch that takes a rack down: a few names, then how many more.
    rack = [f"n{i:04d}" for i in range(300)]
    assert lost_text(rack, []) == (
        "node(s) n0000, n0001, n0002, n0003, n0004, n0005, n0006, n0007, ... and 292 more "
        "do not answer"
    )
