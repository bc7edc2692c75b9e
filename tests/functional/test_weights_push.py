"""Weight push for real: one coordinator, three node agents serving gRPC to each other, and
jobs under them. The RL example's trainer publishes on n0; replica jobs on n1 and n2 follow
the channel and update in place; the bytes go agent to agent, never through the store.

Every rollout a replica made is checked against the trainer: it ran wholly on one version
(the weights' digest before and after it match), and that version's weights are the
trainer's, bit for bit."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from snapshotter import errors
from snapshotter.v1 import coordinator_pb2 as pb
from tests.conftest import skip_without_criu
from tests.support.agents import Cluster

pytestmark = pytest.mark.timeout(420)
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "rl_weights.py"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, ("n0", "n1", "n2"), EXAMPLE, tcp=True)
    try:
        yield c
    finally:
        c.close()


def _check_rollouts(replica: dict, trainer: dict) -> list[int]:
    versions = trainer["versions"]
    seen = []
    for r in replica["rollouts"]:
        assert r["before"] == r["after"], f"rollout {r['n']} mixed two versions"
        assert r["before"] == versions[str(r["version"])], f"rollout {r['n']} ran on other weights"
        seen.append(r["version"])
    assert seen == sorted(seen), "a replica went back to an older version"
    return seen


def test_two_replicas_follow_the_trainer_and_a_late_one_gets_the_newest(
    cluster: Cluster, tmp_path: Path
) -> None:
    rollouts = str(tmp_path / "rollouts")
    common = ("--rollouts", rollouts)
    r1 = cluster.run("replica-1", "n1", "--role", "replica", "--name", "r1", *common)
    r2 = cluster.run("replica-2", "n2", "--role", "replica", "--name", "r2", "--gen-s", "0.3",
                     *common)  # fmt: skip
    tr = cluster.run("trainer", "n0", "--role", "trainer", "--versions", "25", *common)
    trainer = cluster.wait(tr)
    one, two = cluster.wait(r1), cluster.wait(r2)
    seen1, seen2 = _check_rollouts(one, trainer), _check_rollouts(two, trainer)
    # Both followed along (more than one version each), and the learner learned from them.
    assert len(set(seen1)) > 3 and len(set(seen2)) > 1, (seen1, seen2)
    steps = trainer["steps"]
    assert len(steps) == 24 and all(s["used"] for s in steps)
    assert max(s["reward"] for s in steps[-5:]) > steps[0]["reward"]
    # The bytes went agent to agent: each replica node pulled versions whole.
    n1, n2 = cluster.agents["n1"].weights, cluster.agents["n2"].weights
    assert n1.pulled >= 3 and n2.pulled >= 2
    assert n1.fetched_bytes > 0 and n2.fetched_bytes > 0
    # The board lists the channel (no ticket), to its tenant and the provider only.
    (ch,) = cluster.coord.weights.listing(None).channels
    assert (ch.tenant, ch.channel, ch.version, ch.publisher) == ("default", "policy", 25, "n0")
    assert {"n1", "n2"} <= set(ch.holders) and not ch.failed
    assert list(cluster.coord.weights.listing("default").channels) == [ch]
    assert not cluster.coord.weights.listing("other").channels
    # A replica that joins after the trainer is done starts from the newest version.
    (tmp_path / "rollouts" / "done").unlink()
    late = cluster.run("replica-3", "n2", "--role", "replica", "--name", "r3",
                       "--max-rollouts", "2", *common)  # fmt: skip
    got = cluster.wait(late)
    assert [r["version"] for r in got["rollouts"]] == [25, 25]
    _check_rollouts(got, trainer)


def test_a_replica_killed_during_the_push_costs_the_trainer_and_the_other_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    rollouts = str(tmp_path / "rollouts")
    common = ("--rollouts", rollouts)
    r1 = cluster.run("replica-1", "n1", "--role", "replica", "--name", "r1", *common)
    r2 = cluster.run("replica-2", "n2", "--role", "replica", "--name", "r2", *common)
    tr = cluster.run("trainer", "n0", "--role", "trainer", "--versions", "30", *common)
    # Once replica 2 took a few versions, kill its rank (its agent is mid-pull or between).
    deadline = time.monotonic() + 120
    while cluster.agents["n2"].weights.pulled < 3:
        assert time.monotonic() < deadline, cluster.log(r2)
        time.sleep(0.1)
    pids = [r.pid for r in cluster.coord.status(r2).ranks if r.pid]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    trainer = cluster.wait(tr)
    one = cluster.wait(r1)
    assert len(trainer["steps"]) == 29
    seen = _check_rollouts(one, trainer)
    assert seen[-1] >= 25, seen  # replica 1 kept following to the end
    assert cluster.coord.wait(r2, 60).state == "FAILED"


def test_a_dead_tree_parent_falls_back_to_the_publisher(cluster: Cluster, tmp_path: Path) -> None:
    """The pull itself, given a plan whose first source (the tree parent) is gone."""
    rollouts = str(tmp_path / "rollouts")
    tr = cluster.run("trainer", "n0", "--role", "trainer", "--versions", "1", "--linger-s",
                     "30", "--rollouts", rollouts)  # fmt: skip
    hub0 = cluster.agents["n0"].weights
    deadline = time.monotonic() + 120
    while not hub0._versions:
        assert time.monotonic() < deadline, cluster.log(tr)
        time.sleep(0.1)
    ((key, versions),) = hub0._versions.items()
    v = versions[-1]
    plan = pb.WeightsPlan(channel=key[1], lineage=v.index.lineage, version=v.index.version,
                          token=v.token, tenant=key[0])  # fmt: skip
    plan.sources.add(node="gone", address=f"unix:{tmp_path / 'nobody.sock'}")
    plan.sources.add(node="n0", address=cluster.address["n0"])
    got = cluster.agents["n1"].weights.pull(key, plan)
    assert got.held and got.data.read_bytes() == v.data.read_bytes()
    # A wrong ticket reads nothing.
    bad = pb.WeightsPlan()
    bad.CopyFrom(plan)
    bad.token = "0" * 32
    del bad.sources[0]
    with pytest.raises(errors.StorageUnavailable, match="no source had version"):
        cluster.agents["n2"].weights.pull(key, bad)
    # Another tenant's job, on the same channel name, never sees this tenant's weights.
    other = cluster.run("other", "n2", "--role", "replica", "--first-timeout", "5",
                        "--rollouts", str(tmp_path / "other"), tenant="other")  # fmt: skip
    assert cluster.coord.wait(other, 120).state == "FAILED"
    assert "no newer weights on 'policy'" in cluster.log(other)
    assert not (tmp_path / "other.json").read_text().count("rollouts")
    cluster.wait(tr)


def test_a_replica_thawed_on_another_node_follows_the_channel_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A replica frozen (--stop) on n1 and thawed onto n2 subscribes again after its resume:
    n2's agent follows the channel for it, and the versions the trainer publishes after the
    thaw reach it (n1's agent stopped following when the job stopped there)."""
    skip_without_criu()
    rollouts = str(tmp_path / "rollouts")
    common = ("--rollouts", rollouts)
    r1 = cluster.run("replica-1", "n1", "--role", "replica", "--name", "r1", "--gen-s", "0.1",
                     *common)  # fmt: skip
    tr = cluster.run("trainer", "n0", "--role", "trainer", "--versions", "30", *common)
    deadline = time.monotonic() + 120
    while cluster.agents["n1"].weights.pulled < 3:
        assert time.monotonic() < deadline, cluster.log(r1)
        time.sleep(0.1)
    # The trainer waits for rollouts meanwhile (its only replica is frozen).
    events = list(cluster.coord.freeze(pb.FreezeRequest(job_id=r1, stop=True)))
    done = [e.done for e in events if e.HasField("done")]
    assert done and done[0].stopped, events[-3:]
    assert cluster.agents["n2"].weights.pulled == 0
    thawed = list(cluster.coord.thaw(pb.ThawRequest(snapshot_id=done[0].snapshot_id,
                                                    nodes=["n2"])))  # fmt: skip
    assert any(e.HasField("done") for e in thawed), thawed[-3:]
    trainer = cluster.wait(tr)
    one = cluster.wait(r1)
    seen = _check_rollouts(one, trainer)
    assert seen[-1] >= 28, seen  # it followed to the end, through n2's agent
    assert cluster.agents["n2"].weights.pulled >= 3
