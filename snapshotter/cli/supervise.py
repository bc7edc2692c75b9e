"""The CLI of what the coordinator does by itself: snapshot policies (`run` flags and
`policy set|show|clear`), automatic recovery (`run --recover auto`), events and drains.

Flags are turned into typed messages here; the coordinator merges, checks and decides
(snapshotter/coordinator/policy.py, supervisor.py).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from snapshotter import errors
from snapshotter.cli.output import Msg, emit_result
from snapshotter.coordinator import policy as policies
from snapshotter.rpc.client import Client
from snapshotter.rpc.convert import plain
from snapshotter.v1 import common_pb2, coordinator_pb2

pb = coordinator_pb2


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("snapshot policy")
    g.add_argument("--snapshot-every", default=None, metavar="30s|10m|1h|auto|off",
                   help="snapshot the job this often (auto: Young-Daly from its freeze cost "
                        "and the cluster's failure rate)")  # fmt: skip
    g.add_argument(
        "--snapshot-every-steps", default=None, metavar="N", help="snapshot every N optimizer steps"
    )
    g.add_argument("--keep", default=None, metavar="K", help="keep the newest K snapshots")
    g.add_argument(
        "--keep-hourly",
        default=None,
        metavar="DAYS",
        help="also keep one snapshot per hour for DAYS days",
    )
    g.add_argument(
        "--keep-daily",
        default=None,
        metavar="DAYS",
        help="also keep one snapshot per day for DAYS days",
    )


def add_recovery_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("automatic recovery")
    g.add_argument(
        "--recover",
        default=None,
        choices=["auto", "off"],
        help="auto: on a failure, thaw the newest snapshot on healthy nodes",
    )
    g.add_argument(
        "--spares",
        default=None,
        metavar="NODE,...",
        help="nodes that take a lost node's ranks first",
    )
    g.add_argument(
        "--max-recoveries",
        default=None,
        metavar="K",
        help="give up after K recoveries within --recovery-window (default 3)",
    )
    g.add_argument(
        "--recovery-window",
        default=None,
        metavar="SECONDS",
        help="the window --max-recoveries counts in (default 3600)",
    )
    g.add_argument(
        "--hang-deadline",
        default=None,
        metavar="SECONDS",
        help="no collective on any rank for this long is a hang (default 600)",
    )


def _number(flag: str, v: str, kind: Callable[[str], Any], minimum: float) -> Any:
    try:
        n = kind(v)
    except ValueError:
        n = None
    if n is None or n < minimum:
        raise errors.InvalidArgument(f"{flag} {v!r} is not a number >= {minimum:g}", f"fix {flag}")
    return n


def policy_from_flags(a: argparse.Namespace) -> tuple[common_pb2.Policy, bool]:
    """The policy fields the flags give (unset: not given), and whether --snapshot-every was."""
    p = common_pb2.Policy()
    every_given = a.snapshot_every is not None
    if every_given:
        every_s, auto = policies.parse_every(a.snapshot_every)
        if every_s is not None:
            p.every_s = every_s
        p.auto = auto
    if a.snapshot_every_steps is not None:
        p.every_steps = _number("--snapshot-every-steps", a.snapshot_every_steps, int, 1)
    if a.keep is not None:
        p.keep = _number("--keep", a.keep, int, 1)
    if a.keep_hourly is not None:
        p.keep_hourly_days = _number("--keep-hourly", a.keep_hourly, float, 0)
    if a.keep_daily is not None:
        p.keep_daily_days = _number("--keep-daily", a.keep_daily, float, 0)
    return p, every_given


def recovery_from_flags(a: argparse.Namespace) -> common_pb2.Recovery:
    r = common_pb2.Recovery(mode=a.recover or "")
    # torchrun's --max-restarts N: recover automatically, at most N times in the window.
    if a.max_restarts and a.recover is None:
        r.mode = "auto"
        r.max_tries = a.max_restarts
    if a.spares:
        r.spares.extend(n for n in a.spares.split(",") if n)
    if a.max_recoveries is not None:
        r.max_tries = _number("--max-recoveries", a.max_recoveries, int, 1)
    if a.recovery_window is not None:
        r.window_s = _number("--recovery-window", a.recovery_window, float, 1)
    if a.hang_deadline is not None:
        r.hang_deadline_s = _number("--hang-deadline", a.hang_deadline, float, 1)
    if r.mode != "auto" and (r.spares or a.hang_deadline or a.max_recoveries):
        raise errors.InvalidArgument(
            "--spares, --max-recoveries and --hang-deadline only apply with --recover auto",
            "add --recover auto",
        )
    return r


# --------------------------------------------------------------------------- policy
def policy_text(info: Msg) -> str:
    lines = [f"job {info['job_id']}: {info['describe']}"]
    if info.get("auto"):
        au = info["auto"]
        lines.append(
            f"  auto interval {au['interval_s']:.0f}s = sqrt(2 x {au['cost_s']:.2f}s x "
            f"{au['job_mtbf_s'] / 3600:.1f}h job MTBF); cost: "
            + (
                f"median of {au['cost_measured']} freeze(s)"
                if au["cost_measured"]
                else "no freeze measured yet (default)"
            )  # fmt: skip
            + f"; node MTBF {au['node_mtbf_s'] / 3600:.1f}h from {au['failures']} failure(s) "
            f"in {au['node_seconds'] / 3600:.2f} node-hours (with the prior) x {au['nnodes']} "
            "node(s)"
        )
    if info.get("steps") is not None:
        lines.append(f"  steps: {info['steps']} (at the last snapshot: {info.get('anchor_steps')})")
    if info.get("state"):
        lines.append(f"  {info['state']}")
    if info.get("last_error"):
        lines.append(f"  {info['failures']} failed in a row; last: {info['last_error']}")
    return "\n".join(lines)


def cmd_policy(a: argparse.Namespace, c: Client) -> int:
    if a.action == "show":
        info = c.stub.ShowPolicy(common_pb2.JobRef(job_id=a.job_id), timeout=60)
    else:
        req = pb.SetPolicyRequest(job_id=a.job_id, clear=a.action == "clear")
        if a.action == "set":
            pol, every_given = policy_from_flags(a)
            if not pol.ListFields() and not every_given:
                raise errors.InvalidArgument(
                    "`policy set` without a policy flag changes nothing",
                    "give --snapshot-every, --snapshot-every-steps, --keep, --keep-hourly or "
                    "--keep-daily (`policy clear` removes the policy)",
                )
            req.policy.CopyFrom(pol)
            req.every_given = every_given
        info = c.stub.SetPolicy(req, timeout=60)
    out = plain(info)
    emit_result(out, a.json, None, policy_text(out))
    return 0


# --------------------------------------------------------------------------- events
def event_line(e: Msg) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
    parts = [f"{when} {e['kind']}"]
    if e.get("cause"):
        parts.append(f"cause={e['cause']}")
    if e.get("rank") is not None:
        parts.append(f"rank={e['rank']}")
    if e.get("snapshot_id"):
        parts.append(f"snapshot={e['snapshot_id']}")
    if e.get("steps_lost") is not None:
        parts.append(f"steps_lost={e['steps_lost']}")
    if e.get("detect_s") is not None:
        parts.append(f"detected_after={e['detect_s']:.1f}s")
    if e.get("took_s") is not None:
        parts.append(f"took={e['took_s']:.1f}s")
    if e.get("nodes"):
        parts.append("nodes=" + ",".join(e["nodes"]))
    line = " ".join(parts)
    if e.get("detail"):
        line += f": {e['detail']}"
    return line


def cmd_events(a: argparse.Namespace, c: Client) -> int:
    res = plain(c.stub.Events(common_pb2.JobRef(job_id=a.job_id), timeout=60))
    text = "\n".join(event_line(e) for e in res["events"]) or f"no events for job {a.job_id}"
    emit_result(res, a.json, None, text)
    return 0


# --------------------------------------------------------------------------- drain
def cmd_drain(a: argparse.Namespace, c: Client) -> int:
    req = pb.DrainRequest(node=a.node, undo=a.undo)
    if a.undo and a.self:
        raise errors.InvalidArgument("--self drains a node; it cannot undo a drain",
                                     f"snapshotter drain {a.node} --undo")  # fmt: skip
    if a.undo:
        c.stub.Drain(req, timeout=60)
        emit_result({"node": a.node, "jobs": []}, a.json, None, f"node {a.node} takes jobs again")
        return 0
    if a.grace is not None:
        if a.grace <= 0:
            raise errors.InvalidArgument(f"--grace {a.grace} must be positive", "give seconds")
        req.grace_s = a.grace
    # --self: the node's own certificate (SNAPSHOTTER_TLS_NAME=nodes/NODE), so a preStop hook
    # drains its node with no cluster-wide credential on the node.
    rpc = c.stub.DrainSelf if a.self else c.stub.Drain
    res = plain(rpc(req, timeout=(a.grace or 30.0) + 300))
    lines = [f"node {res['node']} drained: {len(res['jobs'])} job(s)"]
    for j in res["jobs"]:
        if j.get("migrated"):
            lines.append(f"  {j['job_id']}: runs on {','.join(j['thawed_on'])}: {j['detail']}")
            continue
        how = "FALLBACK to" if j["fallback"] else "frozen as"
        where = f"; thawed on {','.join(j['thawed_on'])}" if j["thawed_on"] else ""
        lines.append(f"  {j['job_id']}: {how} {j['snapshot_id'] or '(none)'}{where}: {j['detail']}")
    emit_result(res, a.json, None, "\n".join(lines))
    return 1 if any(j["fallback"] for j in res["jobs"]) else 0


# --------------------------------------------------------------------------- link
def cmd_link(a: argparse.Namespace, c: Client) -> int:
    if a.action == "list":
        res = plain(c.stub.Nodes(common_pb2.Empty(), timeout=60))
        rows = [{"node": n["name"], "plane": i, "iface": x["name"], "ip": x["ip"],
                 "up": x["up"], "drained": x["name"] in n["drained_links"]}
                for n in res["nodes"] for i, x in enumerate(n["links"])]  # fmt: skip
        text = "\n".join(
            f"{r['node']:<12} plane {r['plane']}  {r['iface']:<15} {r['ip'] or '-':<15} "
            f"{'up' if r['up'] else 'DOWN'}{'  drained' if r['drained'] else ''}"
            for r in rows
        ) or "no node reports data links (start agents with --link)"
        emit_result({"links": rows}, a.json, None, text)
        return 0
    if not a.node or not a.iface:
        raise errors.InvalidArgument(f"`link {a.action}` needs NODE and IFACE",
                                     f"snapshotter link {a.action} NODE IFACE")  # fmt: skip
    req = pb.LinkRequest(node=a.node, iface=a.iface, restore=a.action == "restore")
    res = plain(c.stub.Link(req, timeout=900))
    verb = "restored" if a.action == "restore" else "drained"
    lines = [f"link {a.iface} of node {a.node} {verb}: {len(res['jobs'])} job(s) moved"]
    for j in res["jobs"]:
        if j["error"]:
            lines.append(f"  {j['job_id']}: FAILED to move to plane {j['to_plane']}: {j['error']}")
        else:
            lines.append(f"  {j['job_id']}: plane {j['from_plane']} -> {j['to_plane']}, "
                         f"stalled {j['stall_s']:.2f}s")  # fmt: skip
    emit_result(res, a.json, None, "\n".join(lines))
    return 1 if any(j["error"] for j in res["jobs"]) else 0


def add_parsers(sub: Any, common: argparse.ArgumentParser, client: Callable[[], Client]) -> None:
    po = sub.add_parser("policy", parents=[common], help="a job's snapshot policy")
    po.add_argument("action", choices=["set", "show", "clear"])
    po.add_argument("job_id")
    add_policy_flags(po)
    po.set_defaults(fn=lambda a: cmd_policy(a, client()))
    ev = sub.add_parser(
        "events",
        parents=[common],
        help="what happened to a job by itself (snapshots, failures, recoveries)",
    )
    ev.add_argument("job_id")
    ev.set_defaults(fn=lambda a: cmd_events(a, client()))
    dr = sub.add_parser(
        "drain", parents=[common],
        help="move every job off a node that is going away (migrated with --recover auto, "
        "else frozen and stopped)",
    )
    dr.add_argument("node")
    dr.add_argument("--grace", type=float, default=None, help="seconds (default 30)")
    dr.add_argument("--undo", action="store_true", help="the node takes new jobs again")
    dr.add_argument("--self", action="store_true",
                    help="drain as the node itself, with its own certificate "
                    "(SNAPSHOTTER_TLS_NAME=nodes/NODE): what a Kubernetes preStop hook or a "
                    "node's shutdown script runs; a node drains only itself")  # fmt: skip
    dr.set_defaults(fn=lambda a: cmd_drain(a, client()))
    lk = sub.add_parser(
        "link", parents=[common],
        help="the nodes' data links: list them, drain one before maintenance (its jobs move "
        "to another link, ranks in memory), restore it",
    )
    lk.add_argument("action", choices=["list", "drain", "restore"])
    lk.add_argument("node", nargs="?", default=None)
    lk.add_argument("iface", nargs="?", default=None)
    lk.set_defaults(fn=lambda a: cmd_link(a, client()))
