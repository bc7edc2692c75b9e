"""Who slows or stalls a job (coordinator/top_rules.py), the rank's telemetry summary
(hook/telemetry.py) and the node's connection stats (agent/peers.py): pure functions."""

from __future__ import annotations

from snapshotter.agent import peers
from snapshotter.coordinator import top
from snapshotter.coordinator import top_rules as rules
from snapshotter.hook import telemetry
from snapshotter.hook.barrier import channel
from snapshotter.v1 import common_pb2

G = "0"


def rank(r: int, latency: float | list[float], step_s: float = 0.1, steps: int = 100,
         per_step: int = 2, in_flight_s: float = 0.0, state: str = "S", answered: bool = True,
         issued: int | None = None) -> common_pb2.RankProgress:  # fmt: skip
    """`latency`: of each of its latest collectives (the last numbered `issued`), or one for
    all 32 of them."""
    n = steps * per_step if issued is None else issued
    lats = latency if isinstance(latency, list) else [latency] * 32
    mean = sum(lats) / len(lats)
    return common_pb2.RankProgress(
        rank=r, answered=answered, steps=steps if answered else 0,
        counts={G: n} if answered else {}, proc_state=state, in_flight_s=in_flight_s,
        step_s=step_s if answered else 0.0, steps_window=32 if answered else 0,
        timings=[common_pb2.CollectiveTiming(
            group=G, done=n, window=len(lats), mean_s=mean, p50_s=mean,
            seqs=range(n - len(lats) + 1, n + 1), latencies_s=lats)] if answered else [],
    )  # fmt: skip


def node(name: str, *ranks: common_pb2.RankProgress,
         peer_rtt: dict[str, float] | None = None) -> common_pb2.JobProgress:  # fmt: skip
    return common_pb2.JobProgress(
        job_id="j", node=name, ranks=list(ranks),
        peers=[common_pb2.PeerStats(address=a, connections=2, rtt_ms=ms, bytes_sent=5 << 20)
               for a, ms in (peer_rtt or {}).items()],
    )  # fmt: skip


def test_the_rank_its_peers_wait_for_is_the_slowest() -> None:
    nodes = [node("a", rank(0, 0.030), rank(1, 0.028)), node("b", rank(2, 0.002), rank(3, 0.031))]
    v = rules.judge(nodes, {}, hang_s=10)
    assert (v.slowest_rank, v.slowest_node, v.waits_on) == (2, "b", None)
    assert (v.late.aligned, v.late.decisive) == (32, 32)
    assert v.late.share == {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.0}
    row = {r.rank: r for r in v.rows}
    assert abs(row[0].wait_s - 0.060) < 1e-9 and abs(row[0].busy_s - 0.040) < 1e-9
    assert row[2].busy_s > row[0].busy_s
    assert v.findings == ["slowest rank: 2 on node b: the last to join 100% of the 32 "
                          "collectives (of the latest 32) that waited for someone; its peers "
                          "wait 56 ms for it a step"]  # fmt: skip


def test_a_rank_slowed_as_a_whole_is_last_though_its_mean_is_not_low() -> None:
    # Rank 3's own latencies are long (its communicator's threads are slowed too), but it
    # joins each collective last: every peer's latency of the same collective is longer.
    slow = [0.09 if i % 2 else 0.01 for i in range(32)]
    peers = [x + 0.03 for x in slow]
    nodes = [node("a", rank(0, peers, step_s=0.12, per_step=1),
                  rank(1, [x + 0.02 for x in slow], step_s=0.12, per_step=1)),
             node("b", rank(2, peers, step_s=0.12, per_step=1),
                  rank(3, slow, step_s=0.12, per_step=1))]  # fmt: skip
    v = rules.judge(nodes, {}, hang_s=10)
    assert (v.slowest_rank, v.slowest_node) == (3, "b"), v.findings
    assert "its peers wait 30 ms for it a step" in v.findings[0]


def test_collectives_that_waited_for_no_one_say_nothing() -> None:
    # Two allreduces a step: the first waits 50 ms for rank 1, in the second both arrive
    # together and either may look last by a hair. Rank 1 is named, and its peer waits
    # 50 ms a step for it (not 100: one of the two waited).
    r0 = [0.05 if i % 2 == 0 else 0.0003 for i in range(64)]
    r1 = [0.001 if i % 2 == 0 else 0.0004 for i in range(64)]
    v = rules.judge([node("a", rank(0, r0, step_s=0.075), rank(1, r1, step_s=0.075))], {},
                    hang_s=10)  # fmt: skip
    assert (v.late.aligned, v.late.decisive) == (64, 32) and v.slowest_rank == 1, v.findings
    assert "its peers wait 49 ms for it a step" in v.findings[0], v.findings


def test_standing_out_is_relative_to_how_many_ranks_there_are() -> None:
    assert [rules.last_share_needed(n) for n in (2, 3, 4, 5, 8, 1000)] == [
        0.6, 0.6, 0.5, 0.4, 0.25, 0.25]
    # Last in half of them among four, twice as often as anyone else: it stands out.
    def ranks(shares: list[int]) -> list[common_pb2.JobProgress]:
        lats = []
        for r in range(4):
            lats.append([0.001 if (i % 20) < shares[r] + sum(shares[:r]) and
                         (i % 20) >= sum(shares[:r]) else 0.03 for i in range(40)])
        return [node("a", *(rank(r, lats[r], per_step=1) for r in range(4)))]
    assert rules.judge(ranks([2, 3, 5, 10]), {}, hang_s=10).slowest_rank == 3
    # Last in half, but the runner-up in almost as many: no one.
    assert rules.judge(ranks([1, 1, 8, 10]), {}, hang_s=10).slowest_rank is None


def test_even_ranks_name_nobody() -> None:
    # Who joins last changes from one collective to the next; or one rank is always last
    # by a trifle of a step.
    rot = [[0.02 + 0.01 * ((i + r) % 4) for i in range(32)] for r in range(4)]
    trifle = [[0.0004] * 32, [0.0001] * 32, [0.0004] * 32, [0.0004] * 32]
    for lat in (rot, trifle):
        nodes = [node("a", rank(0, lat[0]), rank(1, lat[1])),
                 node("b", rank(2, lat[2]), rank(3, lat[3]))]  # fmt: skip
        v = rules.judge(nodes, {}, hang_s=10)
        assert v.slowest_rank is None and v.findings == [], (lat, v.findings)
        if lat is rot:
            assert v.late.share == {0: 0.25, 1: 0.25, 2: 0.25, 3: 0.25}, v.late
    # Too few collectives lined up (the ranks' windows barely overlap): nobody either.
    nodes = [node("a", rank(0, [0.05] * 8, issued=100), rank(1, [0.001] * 8, issued=105))]
    assert rules.judge(nodes, {}, hang_s=10).slowest_rank is None


def test_without_counted_steps_latency_alone_decides() -> None:
    nodes = [node("a", rank(0, 0.05, step_s=0, steps=0, issued=500),
                  rank(1, 0.001, step_s=0, steps=0, issued=500))]  # fmt: skip
    v = rules.judge(nodes, {}, hang_s=10)
    assert v.slowest_rank == 1 and "a collective" in v.findings[0]


def test_the_main_group_is_the_busiest_and_channels_are_not_groups() -> None:
    r = rank(0, 0.01)
    r.timings.append(common_pb2.CollectiveTiming(group="7", done=3, window=3, mean_s=1.0))
    r.timings.append(common_pb2.CollectiveTiming(group=channel("7", 0, 1), done=10**6,
                                                 window=64, mean_s=1.0))  # fmt: skip
    assert rules.main_group([node("a", r)]) == G


def test_a_hang_names_the_stopped_rank_then_the_one_behind() -> None:
    stuck = [node("a", rank(0, 0.01, in_flight_s=30), rank(1, 0, answered=False, state="T"))]
    v = rules.judge(stuck, {}, hang_s=10)
    assert v.waits_on == 1 and v.slowest_rank is None and v.stalled_s == 30
    assert v.findings[0].startswith("hang: a collective has been in flight 30s; rank 1")
    behind = [node("a", rank(0, 0.01, in_flight_s=12, issued=201), rank(1, 0.01, issued=200))]
    assert rules.judge(behind, {}, hang_s=10).waits_on == 1
    # Below the threshold it is no hang.
    assert rules.judge(behind, {}, hang_s=20).waits_on is None


def test_a_slow_link_and_a_slow_node() -> None:
    owner = {"10.0.0.1": "a", "10.0.0.2": "b", "10.0.0.3": "c"}
    # One pair slow (either side's view counts): that pair.
    nodes = [node("a", peer_rtt={"10.0.0.2": 0.2, "10.0.0.3": 0.3}),
             node("b", peer_rtt={"10.0.0.1": 0.2, "10.0.0.3": 40.0}),
             node("c", peer_rtt={"10.0.0.1": 0.25, "10.0.0.2": 0.3})]  # fmt: skip
    v = rules.judge(nodes, owner, hang_s=10)
    assert v.slowest_link == "b <-> c" and [(x.a, x.b) for x in v.links] == [
        ("a", "b"), ("a", "c"), ("b", "c")]
    assert v.links[2].rtt_ms == 40.0 and v.links[2].bytes_sent == 10 << 20
    # Every pair of one node slow: its link.
    nodes[1] = node("b", peer_rtt={"10.0.0.1": 35.0, "10.0.0.3": 40.0})
    assert rules.judge(nodes, owner, hang_s=10).slowest_link == "b (every link)"
    # Healthy, or addresses of no known node: nothing named.
    nodes[1] = node("b", peer_rtt={"10.0.0.1": 0.3, "10.0.0.3": 0.2, "192.0.2.9": 90.0})
    v = rules.judge(nodes, owner, hang_s=10)
    assert v.slowest_link == "" and len(v.links) == 3


def test_telemetry_summary_merges_sources() -> None:
    lat = telemetry.Latencies()
    for q, s in ((12, 0.1), (11, 0.3)):
        lat.record("0", q, s)
    lat.record(channel("0", 0, 1), 1, 0.5)
    native = {"0": (10, [(10, 0.2)]), "5": (1, [(1, 1.0)])}
    out = telemetry.summary([1.0, 3.0, 2.0], [native, lat.snapshot()])
    assert out["step_s"] == 2.0 and out["steps_window"] == 3
    g = out["groups"]["0"]
    assert (g["done"], g["window"], g["p50_s"]) == (12, 3, 0.2) and abs(g["mean_s"] - 0.2) < 1e-12
    assert g["recent"] == [[10, 200000], [11, 300000], [12, 100000]]
    assert set(out["groups"]) == {"0", "5", channel("0", 0, 1)}
    assert "recent" not in out["groups"][channel("0", 0, 1)]
    lat.forget("0")
    assert lat.snapshot() == {}
    assert telemetry.summary([], []) == {"step_s": 0.0, "steps_window": 0, "groups": {}}


def test_the_latency_ring_keeps_the_latest() -> None:
    lat = telemetry.Latencies()
    for i in range(telemetry.RING + 10):
        lat.record("0", i + 1, float(i))
    done, recent = lat.snapshot()["0"]
    assert done == telemetry.RING + 10 and recent[0] == (11, 10.0)
    assert len(recent) == telemetry.RING


SS = """\
0      0      10.0.0.1:41234    10.0.0.2:29500 users:(("python",pid=11,fd=7))
\t cubic wscale:7,7 rto:204 rtt:12.5/3.1 mss:1448 bytes_sent:5242880 bytes_retrans:2896 \
delivery_rate 19.8Mbps busy:100ms
0      0      10.0.0.1:41240    10.0.0.2:29501 users:(("python",pid=11,fd=8))
\t cubic rtt:3.0/1.0 bytes_sent:2097152 delivery_rate 1.2Gbps
0      0      10.0.0.1:41250    10.0.0.2:29502 users:(("python",pid=12,fd=8))
\t cubic rtt:99.0/1.0 bytes_sent:4000
0      0      [::ffff:127.0.0.1]:29611 [::ffff:127.0.0.1]:46770 users:(("python",pid=11,fd=18))
\t bbr rtt:0.05/0.01 bytes_sent:9999999
0      0      10.0.0.1:41260    10.0.0.3:29500 users:(("python",pid=99,fd=8))
\t cubic rtt:50.0/1.0 bytes_sent:9999999
"""


def test_ss_output_per_peer() -> None:
    conns = peers.parse(SS)
    assert len(conns) == 5 and conns[3].peer == "127.0.0.1" and conns[0].pid == 11
    (p,) = peers.by_peer(conns, {11, 12})
    # The loopback one, the other process's and the one that carried little are left out.
    assert (p.address, p.connections, p.rtt_ms) == ("10.0.0.2", 2, 12.5)
    assert p.bytes_sent == 5242880 + 2097152 and p.bytes_retrans == 2896
    assert p.delivery_bps == 19.8e6
    assert peers.by_peer(conns, set()) == [] and peers.parse("garbage\n\tmore") == []
    # Connections read once for several jobs (a metrics scrape) are used as given.
    assert peers.collect({11, 12}, conns) == [p] and peers.collect(set(), conns) == []


def test_the_report_of_a_busy_job_asks_no_rank_and_of_a_running_one_names() -> None:
    busy = common_pb2.JobProgress(job_id="j", node="a", busy=True,
                                  ranks=[common_pb2.RankProgress(rank=0)])  # fmt: skip
    rep = top.report("j", [busy, node("b", rank(1, 0.01))], {}, hang_s=10)
    assert rep.busy and not rep.ranks and rep.slowest_rank == -1 and rep.waits_on == -1
    assert rep.findings == ["a freeze or thaw holds the job: its ranks were not asked"]
    nodes = [node("a", rank(0, 0.030), rank(1, 0.028)), node("b", rank(2, 0.002), rank(3, 0.031))]
    rep = top.report("j", nodes, {}, hang_s=10)
    assert (rep.slowest_rank, rep.slowest_node, rep.waits_on, rep.aligned) == (2, "b", -1, 32)
    assert [(r.rank, r.node, round(r.last_share, 2)) for r in rep.ranks] == [
        (0, "a", 0.0), (1, "a", 0.0), (2, "b", 1.0), (3, "b", 0.0)]
