"""Application checkpoints' pure parts: names, the page layout of a part, the request a rank
files (untrusted input to a root agent), the spool claims, and the prefixed namespace."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from snapshotter.agent.checkpoints import _claimable
from snapshotter.checkpoint import catalog, spool
from snapshotter.errors import (
    CheckpointNotFound,
    InvalidArgument,
    KeyUnavailable,
    StorageUnavailable,
)
from snapshotter.storage import LocalDirStore
from snapshotter.storage.prefixed import PrefixedStore


def test_every_item_of_a_part_starts_on_a_page() -> None:
    assert catalog.layout([]) == []
    assert catalog.layout([1, 4096, 0, 5000, 3]) == [0, 4096, 8192, 8192, 16384]
    offs = catalog.layout([10, 20, 30])
    assert all(o % catalog.ALIGN == 0 for o in offs)


def test_part_names_are_reserved_and_checkpoint_names_checked() -> None:
    assert catalog.part_id("step-10", 3) == "step-10.part00003"
    assert catalog.check_name("step-10") == "step-10"
    for bad in ("step-10.part00003", "../x", "", "a/b", "x" * 119):
        with pytest.raises(InvalidArgument):
            catalog.check_name(bad)
    with pytest.raises(InvalidArgument):
        catalog.part_id("x", 100_000)
    a, b = catalog.new_name(1_800_000_000.0), catalog.new_name(1_800_000_001.5)
    assert catalog.check_name(a) and a < b


def _request(**over: object) -> bytes:
    d: dict[str, object] = {"op": "part", "id": "ab12", "url": "file:///s", "name": "c1",
                            "index": 0, "seed": "", "extents": [{"fd": 5, "offset": 0,
                                                                 "length": 10}]}  # fmt: skip
    d.update(over)
    return json.dumps(d).encode()


def test_a_well_formed_request_round_trips() -> None:
    r = spool.parse_request(_request())
    assert r.op == "part" and r.extents == (spool.Extent(5, 0, 10),) and r.fds == [5]
    assert spool.parse_request(r.to_json()) == r
    c = spool.Request("commit", "ff", "s3://b/p", "c1", (spool.Extent(7, 0, 3),),
                      parts=("c1.part00000",), meta={"ranks": 1})  # fmt: skip
    assert spool.parse_request(c.to_json()) == c


@pytest.mark.parametrize("bad", [
    b"not json", b"[]", _request(op="rm"), _request(id="../x"), _request(id=7),
    _request(extents="x"), _request(extents=[{"fd": -1, "offset": 0, "length": 1}]),
    _request(extents=[{"fd": 3, "offset": 0, "length": True}]), _request(index=10 ** 6),
    _request(op="commit"), _request(op="commit", parts=[1], meta={}),
    _request(op="commit", parts=[], meta=[]), b"x" * (spool.MAX_REQUEST_BYTES + 1),
])  # fmt: skip
def test_a_malformed_request_is_refused_by_name(bad: bytes) -> None:
    with pytest.raises(InvalidArgument) as e:
        spool.parse_request(bad)
    assert e.value.next_step


def test_a_failed_result_comes_back_as_its_typed_error() -> None:
    assert spool.raise_if_failed(spool.ok(1, 2, 3, 0.5))["stored_bytes"] == 2
    err = StorageUnavailable("bucket gone", "check it")
    with pytest.raises(StorageUnavailable, match="bucket gone") as e:
        spool.raise_if_failed(spool.failed(err))
    assert e.value.next_step == "check it"
    with pytest.raises(Exception, match="ValueError: boom"):
        spool.raise_if_failed(spool.failed(ValueError("boom")))


def test_the_agent_is_used_only_for_its_own_store() -> None:
    env = {spool.SPOOL_ENV: "/sp", spool.STORE_ENV: "s3://b/p", "SNAPSHOTTER_JOB_ID": "j",
           "RANK": "3"}  # fmt: skip
    assert spool.agent_spool(env, "s3://b/p/") == Path("/sp/j/3")
    assert spool.agent_spool(env, "s3://b/other") is None
    assert spool.agent_spool({**env, "RANK": "x"}, "s3://b/p") is None
    assert spool.agent_spool({}, "s3://b/p") is None


def test_an_agent_claims_new_requests_and_those_a_dead_incarnation_took() -> None:
    assert _claimable("req-ab12.json", "inc1") == "ab12"
    assert _claimable("taken-inc0-ab12.json", "inc1") == "ab12"
    assert _claimable("taken-inc1-ab12.json", "inc1") is None  # ours, being served
    for other in ("res-ab12.json", ".req-ab12.tmp", "junk"):
        assert _claimable(other, "inc1") is None


def test_a_prefixed_store_keeps_to_its_namespace(tmp_path: Path) -> None:
    base = LocalDirStore(tmp_path)
    base.put_bytes("snapshots/s1/manifest.json", b"snap")
    ck = PrefixedStore(base, "checkpoints/")
    ck.put_bytes("snapshots/c1/manifest.json", b"ckpt")
    assert (tmp_path / "checkpoints/snapshots/c1/manifest.json").read_bytes() == b"ckpt"
    assert sorted(ck.list_keys()) == ["snapshots/c1/manifest.json"]
    assert [o.key for o in ck.list_objects("snapshots/")] == ["snapshots/c1/manifest.json"]
    assert list(ck.list_dirs("snapshots/")) == ["c1"]
    assert ck.get_bytes("snapshots/c1/manifest.json") == b"ckpt" and ck.head("x") is None
    assert ck.delete_keys(["snapshots/c1/manifest.json"]) == []
    assert base.head("snapshots/s1/manifest.json") == 4
    with pytest.raises(ValueError):
        PrefixedStore(base, "no-slash")
    with pytest.raises(ValueError):
        ck.put_bytes("../escape", b"")


def test_an_empty_store_has_no_newest_checkpoint(tmp_path: Path) -> None:
    store = catalog.checkpoint_store(f"file://{tmp_path}")
    assert catalog.list_checkpoints(store) == []
    with pytest.raises(CheckpointNotFound) as e:
        catalog.latest(store)
    assert "snapshotter.checkpoint.writer" in e.value.next_step


def test_an_agent_without_the_key_of_a_sealed_job_stores_nothing(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from snapshotter.agent.checkpoints import CheckpointSpool
    from snapshotter.agent.runtime import JobTable
    from snapshotter.errors import KeyUnavailable
    from snapshotter.storage.sealing import Seal

    spool_ = CheckpointSpool(tmp_path / "spool", LocalDirStore(tmp_path / "s"), "file:///s",
                             JobTable("n0"), "inc1")  # fmt: skip
    sealed = SimpleNamespace(spec=SimpleNamespace(job_id="j", sealed=True))
    plain = SimpleNamespace(spec=SimpleNamespace(job_id="p", sealed=False))
    assert spool_.key_for(plain) is None  # type: ignore[arg-type]
    with pytest.raises(KeyUnavailable, match="holds no data key") as e:
        spool_.key_for(sealed)  # type: ignore[arg-type]
    assert "thaw" in e.value.next_step
    key = Seal("acme", "0123456789abcdef", bytes(32))
    spool_.hold_key("j", key)
    assert spool_.key_for(sealed) is key  # type: ignore[arg-type]
    spool_.hold_key("j", None)
    with pytest.raises(KeyUnavailable):
        spool_.key_for(sealed)  # type: ignore[arg-type]


def test_a_fetch_names_a_stream() -> None:
    r = spool.parse_request(json.dumps({"op": "fetch", "id": "ab", "url": "u", "name": "c",
                                        "index": 2, "stream": "data", "extents": []}).encode())
    assert (r.op, r.index, r.stream, r.extents) == ("fetch", 2, "data", ())
    assert spool.parse_request(r.to_json()) == r
    with pytest.raises(InvalidArgument, match="unknown stream"):
        spool.parse_request(r.to_json().replace(b'"data"', b'"../etc"'))


def test_housekeeping_keeps_the_key_of_a_job_being_restored(tmp_path: Path) -> None:
    """A restore hands the key before CRIU restores the ranks (seconds): a prune meanwhile
    must not drop it, or the thawed job's first save fails it (seen under load)."""
    import time

    from snapshotter.agent.checkpoints import _PRUNE_AFTER_S, CheckpointSpool
    from snapshotter.agent.runtime import JobTable
    from snapshotter.storage.sealing import Seal

    jobs = JobTable("n0")
    spool_ = CheckpointSpool(tmp_path / "spool", LocalDirStore(tmp_path / "s"), "file:///s",
                             jobs, "inc1")  # fmt: skip
    sealed = SimpleNamespace(spec=SimpleNamespace(job_id="j", sealed=True))
    key = Seal("acme", "0123456789abcdef", bytes(32))
    spool_.hold_key("j", key)
    jobs.begin_launch("j")  # the restore reserved the id; the ranks are not in the table yet
    later = time.monotonic() + 10 * _PRUNE_AFTER_S
    spool_.prune(now=later)
    assert spool_.key_for(sealed) is key  # type: ignore[arg-type]
    jobs.end_launch("j", None)  # the restore failed: nothing runs here under that id
    spool_.prune()  # just handed: kept for a while whatever the table says
    assert spool_.key_for(sealed) is key  # type: ignore[arg-type]
    spool_.prune(now=later)  # long after, with no such job here: dropped
    with pytest.raises(KeyUnavailable):
        spool_.key_for(sealed)  # type: ignore[arg-type]
