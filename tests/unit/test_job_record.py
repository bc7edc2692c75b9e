"""Where a job's ranks run as the coordinator records it: by node rank, with single ranks
moved to other nodes (`migrate --rank`)."""

from __future__ import annotations

from snapshotter.coordinator.core import JobRecord
from snapshotter.launch.spec import JobSpec


def _rec() -> JobRecord:
    spec = JobSpec(job_id="j", script="t.py", script_args=[], module=False, python="python",
                   cwd="/", env={}, nnodes=2, nproc_per_node=2)  # fmt: skip
    return JobRecord(spec=spec, nodes=["a", "b"])


def test_ranks_run_on_their_node_rank_until_one_moves() -> None:
    rec = _rec()
    assert [rec.holder(r) for r in range(4)] == ["a", "a", "b", "b"]
    assert rec.agents == ["a", "b"]
    rec.moved[3] = "c"
    assert [rec.holder(r) for r in range(4)] == ["a", "a", "b", "c"]
    assert rec.agents == ["a", "b", "c"]


def test_a_rank_moved_back_home_is_no_move_any_more() -> None:
    rec = _rec()
    rec.moved = {3: "c", 1: "d"}
    rec.moved[3] = "b"
    rec.settle_moved()
    assert rec.moved == {1: "d"} and rec.agents == ["a", "b", "d"]
    # Its whole node moved where the single rank went: that rank is home again too.
    rec.nodes[0] = "d"
    rec.settle_moved()
    assert rec.moved == {} and rec.agents == ["d", "b"]
