"""A node agent's weight versions, without a coordinator: publish from a real memfd (as a
rank's staging slot), the files and index it writes, what it keeps, and what it refuses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import xxhash

from snapshotter.agent.weights import KEEP_ENDED_S, WeightsHub
from snapshotter.checkpoint import spool
from snapshotter.errors import InvalidArgument
from snapshotter.weights.index import parse_index

SHAPES = {"w": [64, 64], "b": [64]}


def _publish(hub: WeightsHub, version: int, fill: int, job: str = "trainer") -> dict:
    fd = os.memfd_create("slot")
    try:
        blobs = [bytes([fill]) * (4 * 64 * 64), bytes([fill + 1]) * (4 * 64)]
        os.pwrite(fd, blobs[0], 0)
        os.pwrite(fd, blobs[1], 1 << 16)
        extents = (spool.Extent(fd, 0, len(blobs[0])), spool.Extent(fd, 1 << 16, len(blobs[1])))
        meta = {"version": version, "tensors": [{"name": n, "dtype": "float32", "shape": s}
                                                for n, s in SHAPES.items()]}  # fmt: skip
        req = spool.Request("publish", spool.new_id(), "", "policy", extents, meta=meta)
        return hub.handle(job, "acme", req, os.dup)
    finally:
        os.close(fd)


@pytest.fixture
def hub(tmp_path: Path) -> WeightsHub:
    return WeightsHub(tmp_path / "weights", "n0")


def test_publish_copies_hashes_and_points_current_at_it(hub: WeightsHub) -> None:
    assert _publish(hub, 1, 7)["version"] == 1
    cur = json.loads((hub.root / "acme" / "policy" / "current").read_text())
    assert cur["version"] == 1 and cur["lineage"] == "trainer"
    ix = parse_index(Path(cur["index"]).read_bytes())
    data = Path(cur["data"]).read_bytes()
    for e, fill in zip(ix.entries, (7, 8), strict=True):
        got = data[e.offset : e.offset + e.length]
        assert got == bytes([fill]) * e.length
        assert e.digest == xxhash.xxh3_64_hexdigest(got)


def test_two_newest_are_kept_and_older_or_equal_versions_refused(hub: WeightsHub) -> None:
    for v in (1, 2, 3):
        _publish(hub, v, v)
    d = hub.root / "acme" / "policy"
    assert sorted(p.name for p in d.glob("*.bin")) == ["trainer-2.bin", "trainer-3.bin"]
    with pytest.raises(InvalidArgument, match="not newer"):
        _publish(hub, 3, 9)
    # Another lineage (a restarted trainer) starts over.
    _publish(hub, 1, 5, job="trainer-2")
    assert json.loads((d / "current").read_text())["lineage"] == "trainer-2"


def test_an_unused_channel_keeps_its_newest_for_a_while_then_goes(hub: WeightsHub) -> None:
    for v in (1, 2):
        _publish(hub, v, v)
    d = hub.root / "acme" / "policy"
    hub.prune({"trainer"}, now=0.0)  # the trainer still runs here: nothing changes
    assert len(list(d.glob("*.bin"))) == 2
    hub.prune(set(), now=10.0)
    assert [p.name for p in d.glob("*.bin")] == ["trainer-2.bin"]
    assert json.loads((d / "current").read_text())["version"] == 2
    hub.prune(set(), now=10.0 + KEEP_ENDED_S + 1)
    assert not d.exists()


def test_a_publish_whose_extents_do_not_match_its_tensors_is_refused(hub: WeightsHub) -> None:
    fd = os.memfd_create("slot")
    try:
        meta = {"version": 1, "tensors": [{"name": "w", "dtype": "float32", "shape": [4]}]}
        req = spool.Request("publish", spool.new_id(), "", "policy",
                            (spool.Extent(fd, 0, 8),), meta=meta)  # fmt: skip
        with pytest.raises(InvalidArgument, match="extents do not match"):
            hub.handle("trainer", "acme", req, os.dup)
        req = spool.Request("publish", spool.new_id(), "", "../x", (), meta=meta)
        with pytest.raises(InvalidArgument, match="not a valid name"):
            hub.handle("trainer", "acme", req, os.dup)
    finally:
        os.close(fd)
