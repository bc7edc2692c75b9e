"""The coordinator's control plane at scale (issue 17 part 4): for each number of agents, a
real coordinator drives simulated agents x 8 ranks (tests/support/simagents.py: real Agent gRPC
servers, heartbeating like `snapshotter agent`) through a launch, several freezes and a thaw.

Prints, per agents: the median seconds of each freeze phase as the coordinator saw it, the
control-plane sum (prepare park suspend resume commit finish), growth against the first size,
the coordinator's CPU seconds per freeze (and its event loop's, where every fan-out runs: the
part of a phase no number of nodes shares; loop/ctl: the loop's in the control phases and
the dump, i.e. from prepare to the end less the upload), its CPU per second of heartbeats
alone, its RSS; relay_ms: the median time a relay took to deliver a phase and answer; thaw,
thaw_cpu, thaw_thr: one thaw of the newest snapshot onto the same agents (seconds, the
coordinator's CPU seconds, the most threads it ran above those before the thaw).

    .venv/bin/python bench/scale_bench.py [--agents 64,512,2048] [--runs 3] [--heartbeat-s 2]
        [--transports relay,control,unary]   (side by side: what relays and Control streams gain)

The simulated agents share this machine's cores with the coordinator: on few cores, their
answering time is in the figures too (the coordinator's CPU per freeze is not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.scale import FreezeTiming, ScaleRig, rss_mib, table  # noqa: E402


def one_size(agents: int, runs: int, heartbeat_s: float, window_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="scale-") as d, \
            ScaleRig(Path(d), agents, heartbeat_s=heartbeat_s) as rig:  # fmt: skip
        rss_idle = rss_mib()
        launch_s = rig.launch()
        timings: list[FreezeTiming] = []
        for _ in range(runs):
            timings.append(rig.freeze())
        hb_cpu, beats = rig.heartbeat_cpu(window_s)
        report = rig.check(freezes=runs)
        # The newest snapshot thawed as a fork onto the same nodes (after the check: its
        # ranks start a new history).
        thawed = rig.thaw(timings[-1].snapshot_id, "scale-thawed")
        # Each Relay as its relay served it: delivering to its group and answering.
        relays = sorted(x for r in report.values() for x in r["relay_s"])
        return {
            "agents": agents, "start_s": rig.start_s, "launch_s": launch_s,
            "timings": timings, "hb_cpu": hb_cpu, "beats_per_s": beats / window_s,
            "freeze_cpu_s": statistics.median(t.cpu_s for t in timings),
            "loop_cpu_s": statistics.median(t.loop_cpu_s for t in timings),
            "loop_ctl_s": statistics.median(t.loop_ctl_s for t in timings),
            "rss_idle_mib": rss_idle, "rss_mib": rss_mib(),
            "relay_ms": 1000 * statistics.median(relays) if relays else 0.0,
            "thaw_s": thawed.total_s, "thaw_fetch_s": thawed.fetch_s,
            "thaw_restore_s": thawed.restore_s, "thaw_cpu_s": thawed.cpu_s,
            "thaw_threads": thawed.extra_threads,
        }  # fmt: skip


TRANSPORTS = {
    "relay": "control phases as one signed order per group of ~sqrt(N) agents, delivered by "
             "the group's first agent (rpc/relay.py; the default from 256 agents)",
    "control": "the agents' calls carried by one Control stream per agent (rpc/control.py), "
               "no relays (SNAPSHOTTER_RELAY_MIN=0)",
    "unary": "a gRPC call per agent per phase, no relays (SNAPSHOTTER_CONTROL_STREAM=0)",
}
# What each transport sets (read as each coordinator-side agent handle is made, rpc/aio.py,
# and as each fan-out starts, coordinator/agents.py).
ENV = {
    "relay": {"SNAPSHOTTER_CONTROL_STREAM": "1", "SNAPSHOTTER_RELAY_MIN": "2"},
    "control": {"SNAPSHOTTER_CONTROL_STREAM": "1", "SNAPSHOTTER_RELAY_MIN": "0"},
    "unary": {"SNAPSHOTTER_CONTROL_STREAM": "0", "SNAPSHOTTER_RELAY_MIN": "0"},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="64,512,2048")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--heartbeat-s", type=float, default=2.0)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--transports", default="relay,control",
                    help="comma-separated, side by side for each size: relay, control, unary")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    transports = a.transports.split(",")
    if not set(transports) <= set(TRANSPORTS):
        ap.error(f"--transports: choose among {', '.join(TRANSPORTS)}")
    rows: dict[str, dict[int, list[FreezeTiming]]] = {t: {} for t in transports}
    extra: dict[str, dict[int, dict[str, str]]] = {t: {} for t in transports}
    out = []
    for n in (int(x) for x in a.agents.split(",")):
        for tr in transports:
            t0 = time.monotonic()
            os.environ.update(ENV[tr])
            r = one_size(n, a.runs, a.heartbeat_s, a.window_s)
            rows[tr][n] = r["timings"]  # type: ignore[assignment]
            extra[tr][n] = {
                "cpu/frz": f"{r['freeze_cpu_s']:.2f}",
                "loop/frz": f"{r['loop_cpu_s']:.2f}",
                "loop/ctl": f"{r['loop_ctl_s']:.2f}",
                "relay_ms": f"{r['relay_ms']:.0f}",
                "hb_cpu": f"{r['hb_cpu']:.3f}",
                "hb/s": f"{r['beats_per_s']:.0f}",
                "launch": f"{r['launch_s']:.2f}",
                "thaw": f"{r['thaw_s']:.2f}",
                "thaw_cpu": f"{r['thaw_cpu_s']:.2f}",
                "thaw_thr": f"{r['thaw_threads']}",
                "rss_mib": f"{r['rss_mib']:.0f}",
            }
            out.append(
                {k: v for k, v in r.items() if k != "timings"}
                | {"transport": tr, "phases": [t.phases for t in r["timings"]]}
            )  # type: ignore[attr-defined]
            print(f"# {n} agents ({tr}) done in {time.monotonic() - t0:.0f}s", file=sys.stderr,
                  flush=True)  # fmt: skip
    for tr in transports:
        print(f"\n{tr}: {TRANSPORTS[tr]}")
        print(f"freeze phases, median of {a.runs} (s); heartbeats every {a.heartbeat_s}s per "
              "agent; hb_cpu: coordinator CPU s per s of heartbeats alone; thaw: one thaw "
              "of the newest snapshot (s, coordinator CPU s, threads above those before)")
        print(table(rows[tr], extra[tr]))
    if len(transports) > 1:
        first, *others = transports
        for n in rows[first]:
            ctl = {t: statistics.median(x.control_s for x in rows[t][n]) for t in transports}
            print(f"{n} agents, control-plane s: "
                  + ", ".join(f"{t} {ctl[t]:.3f}" for t in transports)
                  + "".join(f"; {first}/{t} {ctl[first] / ctl[t]:.2f}x" for t in others))
    if a.json:
        print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
