"""`snapshotter` command line. Each handler returns an exit code; errors are printed with their
cause and next step and mapped to the error's exit code. Nothing here calls sys.exit but main.

Every call goes through the generated stubs of snapshotter.v1 (rpc/client.py); results are
printed as text, or with --json as plain JSON (numbers stay numbers: rpc/convert.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from snapshotter import __version__, errors
from snapshotter.cli import gc as gc_cli
from snapshotter.cli import keys as keys_cli
from snapshotter.cli import preempt, services, supervise
from snapshotter.cli import tenants as tenants_cli
from snapshotter.cli.connect import coordinator, stop_embedded
from snapshotter.cli.output import Msg, ProgressLine, emit_result, human_bytes, table
from snapshotter.config import Paths, default_home
from snapshotter.launch.spec import validate_job_id
from snapshotter.rpc.client import Client
from snapshotter.rpc.convert import plain
from snapshotter.v1 import common_pb2, coordinator_pb2

pb = coordinator_pb2
TERMINAL = {"FROZEN", "SUCCEEDED", "FAILED", "CANCELLED"}


def _paths() -> Paths:
    return Paths(default_home())


def _client() -> Client:
    return coordinator(_paths())


# --------------------------------------------------------------------------- run
def _nnodes(v: str) -> int:
    if ":" in v:
        lo, hi = v.split(":", 1)
        if lo != hi:
            raise errors.InvalidArgument(
                f"--nnodes {v}: elastic node ranges are not supported",
                "give a fixed node count, e.g. --nnodes 2",
            )
        v = lo
    return _positive("--nnodes", v)


def _positive(flag: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise errors.InvalidArgument(f"{flag} {v!r} is not a positive whole number", "fix it")
    return n


def _nproc(v: str) -> int:
    if v in ("auto", "cpu", "gpu"):
        if v == "gpu":
            return max(1, _gpu_count())
        return 1 if v == "cpu" else max(1, _gpu_count() or 1)
    return _positive("--nproc-per-node", v)


def _gpu_count() -> int:
    try:
        return len([d for d in os.listdir("/dev") if d.startswith("nvidia") and d[6:].isdigit()])
    except OSError:
        return 0


def cmd_run(a: argparse.Namespace) -> int:
    if a.no_python:
        raise errors.InvalidArgument(
            "--no-python is not supported: ranks run through the Python bootstrap that makes "
            "them freezable",
            "run a Python script or module",
        )
    if a.master_addr or a.master_port or a.rdzv_endpoint:
        print(
            "note: the rendezvous server is owned by snapshotter (so it survives thaw); "
            "--master-addr/--master-port/--rdzv-endpoint are ignored",
            file=sys.stderr,
        )
    job_id = a.job_id or a.rdzv_id or ""
    if job_id:
        validate_job_id(job_id)
    script = a.script if a.module else str(Path(a.script))
    if not a.module and not Path(script).exists():
        raise errors.InvalidArgument(f"script {script!r} not found", "check the path")
    req = pb.RunRequest(
        job_id=job_id,
        script=script,
        script_args=a.script_args,
        module=a.module,
        python=sys.executable,
        cwd=os.getcwd(),
        env=dict(os.environ),
        nnodes=_nnodes(a.nnodes),
        nproc_per_node=_nproc(a.nproc_per_node),
        nodes=a.nodes.split(",") if a.nodes else [],
        recovery=supervise.recovery_from_flags(a),
        tenant=a.tenant or "",
        provider_opt_out=a.no_provider_snapshots,
    )
    req.policy.CopyFrom(supervise.policy_from_flags(a)[0])
    c = _client()
    st = c.stub.Run(req, timeout=180)
    job = st.job_id
    if a.detach:
        emit_result(plain(st), a.json, job, f"started job {job} ({len(st.ranks)} ranks)")
        return 0
    print(f"started job {job}", file=sys.stderr)
    with preempt.on_sigterm() as notice:
        st = _attach(c, job, notice)
        if notice.is_set():
            return preempt.preempt(c, job, a.preempt_grace, a.json)
    if st.state == "FROZEN":
        print(f"job {job} was frozen and stopped; thaw it with `snapshotter thaw`", file=sys.stderr)
    emit_result(plain(st), a.json, None)
    return st.exit_code if st.HasField("exit_code") else 0


def _attach(c: Client, job: str, stop: threading.Event | None = None) -> pb.JobStatus:
    """Stream every rank's output while the job runs, like torchrun does (bytes as they are),
    until it ends or `stop` is set."""
    offsets: dict[int, int] = {}
    out = sys.stdout.buffer
    while True:
        st = c.stub.Status(common_pb2.JobRef(job_id=job), timeout=30)
        done = st.state in TERMINAL
        for r in st.ranks:
            req = common_pb2.LogsRequest(job_id=job, rank=r.rank, offset=offsets.get(r.rank, 0))
            for chunk in c.stub.Logs(req):
                offsets[r.rank] = chunk.offset + len(chunk.data)
                out.write(chunk.data)
        out.flush()
        if done or (stop is not None and stop.is_set()):
            return st  # type: ignore[no-any-return]
        if stop is not None:
            stop.wait(0.5)
        else:
            time.sleep(0.5)


# --------------------------------------------------------------------------- freeze / thaw
def _event(ev: Any) -> Msg:
    """A stream event as one flat line: {"event": phase|progress|done, ...its fields}."""
    kind = ev.WhichOneof("event")
    return {"event": kind, **plain(getattr(ev, kind))}


def _drive(stream: Iterable[Any], progress: ProgressLine) -> Msg:
    result: Msg | None = None
    for ev in stream:
        flat = _event(ev)
        if flat["event"] == "done":
            result = flat
        else:
            progress.event(flat)
    if result is None:
        raise errors.Internal("the operation ended without a result", "see the daemon log")
    return result


def cmd_freeze(a: argparse.Namespace) -> int:
    c = _client()
    req = pb.FreezeRequest(job_id=a.job_id, stop=a.stop)
    if a.quiesce_timeout is not None:
        req.quiesce_timeout_s = a.quiesce_timeout
    res = _drive(c.stub.Freeze(req), ProgressLine(a.json))
    st = res["stats"]
    text = (
        f"snapshot {res['snapshot_id']} committed: {human_bytes(st['image_bytes'])} of images, "
        f"{human_bytes(st.get('uploaded_bytes', 0))} uploaded (the rest was stored already); "
        f"quiesce {st['quiesce_s']:.2f}s, dump {st['dump_s']:.2f}s, upload {st['upload_s']:.2f}s"
        + (f", job stalled {st['stall_s']:.2f}s" if st.get("stall_s") is not None else "")
        + ("; job stopped" if res["stopped"] else "; job continues")
    )
    print(text, file=sys.stderr)
    emit_result(res, a.json, res["snapshot_id"])
    return 0


def cmd_thaw(a: argparse.Namespace) -> int:
    c = _client()
    req = pb.ThawRequest(
        snapshot_id=a.snapshot, job_id=a.job_id or "", nodes=a.nodes.split(",") if a.nodes else [],
        allow_unsigned=a.allow_unsigned,
    )
    res = _drive(c.stub.Thaw(req), ProgressLine(a.json))
    st = res["stats"]
    local = sorted(n["node"] for n in st.get("nodes", []) if n.get("local_copy"))
    print(
        f"job {res['job_id']} thawed from {a.snapshot}: fetch+verify {st['fetch_s']:.2f}s"
        + (f" (node(s) {', '.join(local)} from their verified local copy)" if local else "")
        + f", restore {st['restore_s']:.2f}s",
        file=sys.stderr,
    )
    emit_result(res, a.json, res["job_id"])
    return 0


def cmd_migrate(a: argparse.Namespace) -> int:
    c = _client()
    req = pb.MigrateRequest(job_id=a.job_id, node=a.node or "", to=a.to, via_store=a.via_store)
    if a.rank is not None:
        req.rank = a.rank
    if a.quiesce_timeout is not None:
        req.quiesce_timeout_s = a.quiesce_timeout
    res = _drive(c.stub.Migrate(req), ProgressLine(a.json))
    st = res["stats"]
    print(
        f"job {res['job_id']}: rank(s) {', '.join(map(str, st.get('ranks', [])))} moved from "
        f"{res['node']} to {res['to']}; job stalled {st['downtime_s']:.2f}s (dump "
        f"{st['dump_s']:.2f}s, transfer {human_bytes(st['image_bytes'])} in "
        f"{st['transfer_s']:.2f}s, restore {st['restore_s']:.2f}s, rebuild {st['resume_s']:.2f}s)",
        file=sys.stderr,
    )
    emit_result(res, a.json, ",".join(res["nodes"]))
    return 0


# --------------------------------------------------------------------------- queries
def cmd_jobs(a: argparse.Namespace) -> int:
    res = _client().stub.Jobs(common_pb2.Empty(), timeout=60)
    rows = [
        [j.job_id, j.state, str(len(j.ranks)), ",".join(j.nodes), str(len(j.snapshots))]
        for j in res.jobs
    ]
    text = table(rows, ["JOB", "STATE", "RANKS", "NODES", "SNAPSHOTS"])
    emit_result(plain(res), a.json, None, text)
    return 0


def _status_text(st: Msg) -> str:
    lines = [
        f"job {st['job_id']}: {st['state']}  ({st['nnodes']} node(s) x "
        f"{st['nproc_per_node']} rank(s); {st['script']})"
    ]
    for r in st["ranks"]:
        code = "" if r.get("exit_code") is None else f" exit {r['exit_code']}"
        lines.append(f"  rank {r['rank']}: pid {r['pid']}{code}")
    if st["snapshots"]:
        lines.append("  snapshots: " + ", ".join(st["snapshots"]))
    if st.get("thawed_from"):
        lines.append(f"  thawed from {st['thawed_from']}")
    if st.get("recovery", {}).get("mode") == "auto":
        lines.append(f"  recover auto: {st.get('recoveries', 0)} recovery(ies)")
    if st.get("gave_up"):
        lines.append(f"  recovery stopped: {st['gave_up']}")
    for e in st.get("events", [])[-5:]:
        lines.append("  event " + supervise.event_line(e))
    return "\n".join(lines)


def cmd_status(a: argparse.Namespace) -> int:
    c = _client()
    if a.job_id is not None:
        st = plain(c.stub.Status(common_pb2.JobRef(job_id=a.job_id), timeout=60))
        emit_result(st, a.json, None, _status_text(st))
        return 0
    res = {
        "coordinator": plain(c.stub.Ping(common_pb2.Empty(), timeout=30)),
        **plain(c.stub.Nodes(common_pb2.Empty(), timeout=60)),
    }
    emit_result(res, a.json, None, _services_text(res))
    return 0


def _resources_text(r: Msg) -> str:
    return (
        f"fds {r['fds']}, threads {r['threads']}, children {r['children']}, "
        f"zombies {r['zombies']}, rss {human_bytes(r['rss_bytes'])}"
    )


def _services_text(res: Msg) -> str:
    co = res["coordinator"]
    head = f"coordinator v{co['version']} pid {co['pid']}, store {co['store']}"
    lines = [f"{head}: {_resources_text(co['resources'])}"]
    for n in res["nodes"]:
        if n.get("error"):
            lines.append(f"  node {n['name']} ({n['address']}): not answering: {n['error']}")
            continue
        ag = n["agent"]
        jobs = ", ".join(ag["running_jobs"]) or "none"
        lines.append(
            f"  node {n['name']} ({n['address']}, v{ag['version']} pid {ag['pid']}): "
            f"{_resources_text(ag['resources'])}; running jobs: {jobs}"
        )
    return "\n".join(lines)


def cmd_wait(a: argparse.Namespace) -> int:
    c = _client()
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    while True:
        left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
        st = c.stub.Wait(common_pb2.WaitRequest(job_id=a.job_id, timeout_s=left), timeout=left + 30)
        if st.state in TERMINAL or (deadline is not None and time.monotonic() >= deadline):
            break
    out = plain(st)
    emit_result(out, a.json, None, _status_text(out))
    if st.state not in TERMINAL:
        return 124
    return st.exit_code if st.HasField("exit_code") else 0


def cmd_logs(a: argparse.Namespace) -> int:
    c = _client()
    if a.follow and a.rank is None:
        raise errors.InvalidArgument("--follow needs --rank", "pick one rank to follow")
    req = common_pb2.LogsRequest(job_id=a.job_id, follow=a.follow)
    if a.rank is not None:
        req.rank = a.rank
    for chunk in c.stub.Logs(req):
        sys.stdout.buffer.write(chunk.data)
        sys.stdout.buffer.flush()
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    st = plain(_client().stub.Cancel(common_pb2.JobRef(job_id=a.job_id), timeout=120))
    emit_result(st, a.json, None, _status_text(st))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    res = _client().stub.ListSnapshots(pb.ListSnapshotsRequest(job_id=a.job or ""), timeout=120)
    rows = [
        [
            s.snapshot_id,
            s.job_id,
            str(s.ranks),
            human_bytes(s.stored_bytes),
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s.created)),
        ]
        for s in res.snapshots
    ]
    text = table(rows, ["SNAPSHOT", "JOB", "RANKS", "STORED", "CREATED"])
    emit_result(plain(res), a.json, None, text)
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    d = plain(_client().stub.ShowSnapshot(pb.SnapshotRef(snapshot_id=a.snapshot), timeout=60))
    res = {**d.pop("summary"), **d}
    emit_result(res, a.json, None, json.dumps(res, indent=2, default=str))
    return 0


def cmd_delete(a: argparse.Namespace) -> int:
    res = _client().stub.DeleteSnapshot(pb.SnapshotRef(snapshot_id=a.snapshot), timeout=300)
    emit_result(plain(res), a.json, None, f"deleted {a.snapshot}")
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    stopped = stop_embedded(_paths(), a.force)
    emit_result(
        {"stopped": stopped},
        a.json,
        None,
        "embedded coordinator stopped" if stopped else "nothing running",
    )
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    p = argparse.ArgumentParser(
        prog="snapshotter",
        description="Transparent freeze/thaw of running PyTorch jobs.",
    )
    p.add_argument("--version", action="version", version=f"snapshotter {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_)
        sp.set_defaults(fn=fn)
        return sp

    r = add("run", cmd_run, "launch a job (torchrun-compatible flags)")
    r.add_argument("--nproc-per-node", "--nproc_per_node", default="1")
    r.add_argument("--nnodes", default="1")
    r.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        help="accepted for torchrun compatibility; the coordinator places nodes",
    )
    r.add_argument("--master-addr", "--master_addr", default=None)
    r.add_argument("--master-port", "--master_port", type=int, default=None)
    r.add_argument("--rdzv-backend", "--rdzv_backend", default=None)
    r.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None)
    r.add_argument("--rdzv-id", "--rdzv_id", default=None, help="used as the job id")
    r.add_argument("--standalone", action="store_true")
    r.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    r.add_argument("--nodes", default=None, help="comma-separated agent names to place on")
    r.add_argument("-m", "--module", action="store_true")
    r.add_argument("--no-python", "--no_python", action="store_true")
    r.add_argument("--job-id", default=None)
    r.add_argument("--tenant", default=None,
                   help="whose job it is (default: default): its snapshots are sealed under "
                   "this tenant's data keys")  # fmt: skip
    r.add_argument("--no-provider-snapshots", action="store_true",
                   help="the provider (a caller of no tenant) may not freeze this job; its "
                   "tenant's freezes and its own policy still may")  # fmt: skip
    r.add_argument("--detach", "-d", action="store_true")
    r.add_argument(
        "--preempt-grace",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds to freeze and stop the job in (default 30)",
    )
    supervise.add_policy_flags(r)
    supervise.add_recovery_flags(r)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)

    f = add("freeze", cmd_freeze, "snapshot a running job")
    f.add_argument("job_id")
    f.add_argument("--stop", action="store_true", help="end the job once the snapshot is committed")
    f.add_argument("--quiesce-timeout", type=float, default=None)

    t = add("thaw", cmd_thaw, "resume a job from a snapshot")
    t.add_argument("snapshot")
    t.add_argument("--job-id", default=None)
    t.add_argument("--nodes", default=None)
    t.add_argument("--allow-unsigned", action="store_true",
                   help="thaw a snapshot that has no signature (taken before signing existed)")

    m = add("migrate", cmd_migrate, "move a running job's ranks off a node; the rest stay")
    m.add_argument("job_id")
    which = m.add_mutually_exclusive_group(required=True)
    which.add_argument("--node", default=None, help="move every rank of this node (a drain)")
    which.add_argument("--rank", type=int, default=None,
                       help="move only this rank (its node's other ranks stay)")
    m.add_argument("--to", required=True, help="the node to move them to")
    m.add_argument("--via-store", action="store_true",
                   help="through object storage instead of agent to agent (agents that cannot "
                   "reach each other)")
    m.add_argument("--quiesce-timeout", type=float, default=None)

    add("jobs", cmd_jobs, "list jobs")
    s = add("status", cmd_status, "show a job, or without one the services and their resources")
    s.add_argument("job_id", nargs="?", default=None)
    w = add("wait", cmd_wait, "wait until a job ends")
    w.add_argument("job_id")
    w.add_argument("--timeout", type=float, default=None)
    lg = add("logs", cmd_logs, "show rank output")
    lg.add_argument("job_id")
    lg.add_argument("--rank", type=int, default=None)
    lg.add_argument("--follow", "-f", action="store_true")
    cn = add("cancel", cmd_cancel, "stop a job")
    cn.add_argument("job_id")
    ls = add("list", cmd_list, "list committed snapshots")
    ls.add_argument("--job", default=None)
    sh = add("show", cmd_show, "describe a snapshot")
    sh.add_argument("snapshot")
    de = add("delete", cmd_delete, "delete a snapshot")
    de.add_argument("snapshot")
    dn = add("down", cmd_down, "stop the embedded coordinator and agent")
    dn.add_argument("--force", action="store_true", help="also stop running jobs")
    gc_cli.add_parser(sub).set_defaults(fn=lambda a: gc_cli.run(a, _client()))
    keys_cli.add_parser(sub)
    tenants_cli.add_parser(sub)
    services.add_parsers(sub, common)
    supervise.add_parsers(sub, common, _client)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a))
    except errors.SnapshotterError as e:
        if getattr(a, "json", False):
            print(json.dumps({"error": e.to_dict()}, default=str))
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
