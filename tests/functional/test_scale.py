"""The coordinator at scale (issue 17 part 4): 512 simulated agents x 8 ranks, each a real
Agent gRPC server heartbeating the real coordinator service, through a launch, two real
freezes and a thaw of the second; the phase table is printed (no timing is asserted: this
machine is shared)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from snapshotter import errors
from snapshotter.coordinator import snapshots
from tests.support.scale import ScaleRig, rss_mib, table

pytestmark = pytest.mark.timeout(240)

AGENTS, NPROC = 512, 8


def test_512_agents_freeze_in_order_commit_and_stay_alive(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SNAPSHOTTER_RELAY_MIN", raising=False)  # relays from 256 agents
    # Heartbeats every second: twice a real agent's rate, so the window below sees plenty.
    with ScaleRig(tmp_path, AGENTS, NPROC, heartbeat_s=1.0) as rig:
        launch_s = rig.launch()
        runs = [rig.freeze(), rig.freeze()]
        hb_cpu, beats = rig.heartbeat_cpu(window_s=4.0)
        report = rig.check(freezes=2)  # every rank: every phase in order, twice; none lost

        # Both snapshots are committed (a signed manifest in the store) and recorded.
        ids = [r.snapshot_id for r in runs]
        assert len(set(ids)) == 2
        listed = {s.snapshot_id for s in snapshots.list_snapshots(rig.store, "scale").snapshots}
        assert set(ids) <= listed
        assert rig.coord.job("scale").snapshots[-2:] == ids
        # Every agent kept beating and none failed; each was asked each phase once per freeze.
        assert beats > AGENTS  # at least one heartbeat per agent within the window
        assert all(r["beat_failures"] == 0 and r["beats"] >= 3 for r in report.values())
        assert all(r["calls"].get("prepare") == 2 and r["calls"].get("finish") == 2
                   for r in report.values())  # fmt: skip
        # The control phases went through relays (rpc/relay.py, the default from 256 agents):
        # each agent ran each of the five, twice, as a relayed call, and the coordinator sent
        # each phase to the groups' first agents only (about sqrt(512) of them).
        relayed = {n: r["calls"].get("relayed") for n, r in report.items()}
        assert set(relayed.values()) == {10}, relayed
        relays = {n: r["calls"]["relay"] for n, r in report.items() if "relay" in r["calls"]}
        assert set(relays.values()) == {10} and 16 <= len(relays) <= 32, relays
        # Every call rode Control streams (rpc/control.py), opened once and kept: the
        # coordinator's to each agent, and its relay's.
        streams = {n: r["calls"].get("control") for n, r in report.items()}
        assert set(streams.values()) == {2}, streams

        # The newest snapshot thaws as a fork onto the same nodes: every node fetches its own
        # stream and restores its own ranks once (the simulated agents refuse anything else),
        # and the fan-outs ride the event loop: no thread per node (there were two per node).
        thawed = rig.thaw(ids[-1], "scale-thawed")
        after = rig.hosts.report()
        assert not [r["refused"] for r in after.values() if r["refused"]]
        assert all(r["calls"].get("fetch") == 1 and r["calls"].get("restore") == 1
                   and "discard_fetch" not in r["calls"] for r in after.values())  # fmt: skip
        job = rig.coord.job("scale-thawed")
        assert not job.busy and job.thawed_from == ids[-1] and job.nodes == list(rig.hosts.names)
        assert rig.coord.status("scale-thawed").state == "RUNNING"
        assert thawed.extra_threads < AGENTS // 8, thawed

        # A hang at scale: the ranks of 100 nodes never park. The freeze fails with an error
        # a person can read (a few ranks named, two of them described), every node unparks
        # its ranks once, and the job goes on: the next freeze goes through.
        assert rig.hosts.stick(rig.hosts.names[:100]) == 100
        with pytest.raises(errors.QuiesceTimeout) as failed:
            rig.freeze("scale-thawed")
        cause = failed.value.cause
        assert cause.startswith("rank(s) 0, 1, 2, 3, 4, 5, 6, 7, ... and 792 more did not "
                                "reach collective barrier"), cause[:300]  # fmt: skip
        assert "rank 0 did not answer 'parked'" in cause and "rank 1 did not answer" in cause
        assert "rank 2 did not answer" not in cause and "... and 798 more" in cause
        assert len(str(failed.value)) < 4096, len(str(failed.value))
        hung = rig.hosts.report()
        assert not [r["refused"] for r in hung.values() if r["refused"]]
        assert all(r["calls"].get("abort") == 1 for r in hung.values())
        assert all(seen == ["prepare", "park", "abort"]
                   for r in hung.values() for seen in r["ranks"].values())  # fmt: skip
        assert not rig.coord.job("scale-thawed").busy
        assert rig.coord.status("scale-thawed").state == "RUNNING"
        assert rig.hosts.stick([]) == 0
        again = rig.freeze("scale-thawed")
        assert again.snapshot_id in {
            s.snapshot_id for s in snapshots.list_snapshots(rig.store, "scale-thawed").snapshots
        }
        with capsys.disabled():
            print(f"\n{AGENTS} simulated agents x {NPROC} ranks: started in {rig.start_s:.2f}s, "
                  f"launch {launch_s:.2f}s")  # fmt: skip
            print(table({AGENTS: runs}, {AGENTS: {
                "hb_cpu": f"{hb_cpu:.3f}", "hb/s": f"{beats / 4.0:.0f}",
                "rss_mib": f"{rss_mib():.0f}"}}))  # fmt: skip
            print(f"thaw: fetch {thawed.fetch_s:.2f}s, restore {thawed.restore_s:.2f}s, "
                  f"total {thawed.total_s:.2f}s, coordinator CPU {thawed.cpu_s:.2f}s, "
                  f"{thawed.extra_threads} more threads")  # fmt: skip


def test_heartbeats_stay_under_the_coordinators_bound_and_no_agent_is_lost(
    tmp_path: Path,
) -> None:
    # 64 agents that would beat every second (64/s), against a bound of 8/s: each is asked to
    # wait 8 s, and none counts as lost for beating that seldom.
    with ScaleRig(tmp_path, 64, 1, heartbeat_s=1.0, max_beats_per_s=8.0) as rig:
        # Those that registered first, among fewer, were asked less; all have beaten since
        # (their own 1 s), and have had the 8 s they were then asked for.
        rig.heartbeat_cpu(window_s=9.0)
        asked = {n: a.beat_s for n, a in rig.coord.live_agents().items()}
        assert set(asked.values()) == {8.0}, asked
        _, beats = rig.heartbeat_cpu(window_s=10.0)
        assert beats <= 8.0 * 10.0 * 1.5, beats  # unbounded: ~640
        assert beats >= 64, beats  # each agent beat within its interval
        assert len(rig.coord.live_agents()) == 64
