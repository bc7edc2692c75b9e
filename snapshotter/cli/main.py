"""`snapshotter` command line. Each handler returns an exit code; errors are printed with their
cause and next step and mapped to the error's exit code. Nothing here calls sys.exit but main.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from snapshotter import errors
from snapshotter.cli import gc as gc_cli
from snapshotter.cli.connect import coordinator_client, stop_embedded
from snapshotter.cli.output import Progress, emit_result, human_bytes, table
from snapshotter.config import Paths, default_home
from snapshotter.launch.spec import validate_job_id
from snapshotter.rpc.wire import Client

Msg = dict[str, Any]
TERMINAL = {"FROZEN", "SUCCEEDED", "FAILED", "CANCELLED"}


def _paths() -> Paths:
    return Paths(default_home())


def _client() -> Client:
    return coordinator_client(_paths())


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
    return int(v)


def _nproc(v: str) -> int:
    if v in ("auto", "cpu", "gpu"):
        if v == "gpu":
            return max(1, _gpu_count())
        return 1 if v == "cpu" else max(1, _gpu_count() or 1)
    return int(v)


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
            "note: the rendezvous store is owned by snapshotter (so it survives thaw); "
            "--master-addr/--master-port/--rdzv-endpoint are ignored",
            file=sys.stderr,
        )
    job_id = a.job_id or a.rdzv_id
    if job_id:
        validate_job_id(job_id)
    script = a.script if a.module else str(Path(a.script))
    if not a.module and not Path(script).exists():
        raise errors.InvalidArgument(f"script {script!r} not found", "check the path")
    req = {
        "job_id": job_id,
        "script": script,
        "script_args": a.script_args,
        "module": a.module,
        "python": sys.executable,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "nnodes": _nnodes(a.nnodes),
        "nproc_per_node": _nproc(a.nproc_per_node),
        "nodes": a.nodes.split(",") if a.nodes else None,
    }
    c = _client()
    st = c.call("Run", req, timeout=180)
    job = st["job_id"]
    if a.detach:
        emit_result(st, a.json, job, f"started job {job} ({len(st['ranks'])} ranks)")
        return 0
    print(f"started job {job}", file=sys.stderr)
    st = _attach(c, job)
    if st["state"] == "FROZEN":
        print(f"job {job} was frozen and stopped; thaw it with `snapshotter thaw`", file=sys.stderr)
    emit_result(st, a.json, None)
    return int(st.get("exit_code") or 0)


def _attach(c: Client, job: str) -> Msg:
    """Stream every rank's output while the job runs, like torchrun does."""
    offsets: dict[int, int] = {}
    pending: dict[int, str] = {}

    def pump(final: bool, ranks: list[int]) -> None:
        for rk in ranks:
            for ev in c.stream("Logs", {"job_id": job, "rank": rk, "offset": offsets.get(rk, 0)}):
                offsets[rk] = ev["offset"] + len(ev["data"].encode())
                text = pending.pop(rk, "") + ev["data"]
                *lines, rest = text.split("\n")
                for ln in lines:
                    sys.stdout.write(ln + "\n")
                if rest:
                    pending[rk] = rest
            if final and pending.get(rk):
                sys.stdout.write(pending.pop(rk) + "\n")
        sys.stdout.flush()

    while True:
        st = c.call("Status", {"job_id": job})
        ranks = [r["rank"] for r in st["ranks"]]
        done = st["state"] in TERMINAL
        pump(done, ranks)
        if done:
            return st
        time.sleep(0.5)


# --------------------------------------------------------------------------- freeze / thaw
def _drive(stream: Any, progress: Progress, final_event: str) -> Msg:
    result: Msg | None = None
    for ev in stream:
        if ev.get("event") == final_event:
            result = ev
        else:
            progress.event(ev)
    if result is None:
        raise errors.Internal("the operation ended without a result", "see the daemon log")
    return result


def cmd_freeze(a: argparse.Namespace) -> int:
    c = _client()
    req = {"job_id": a.job_id, "stop": a.stop, "quiesce_timeout": a.quiesce_timeout}
    res = _drive(c.stream("Freeze", req), Progress(a.json), "done")
    st = res["stats"]
    text = (
        f"snapshot {res['snapshot_id']} committed: {human_bytes(st['image_bytes'])} of images; "
        f"quiesce {st['quiesce_s']:.2f}s, dump {st['dump_s']:.2f}s, upload {st['upload_s']:.2f}s"
        + (f", job stalled {st['stall_s']:.2f}s" if st.get("stall_s") is not None else "")
        + ("; job stopped" if res["stopped"] else "; job continues")
    )
    print(text, file=sys.stderr)
    emit_result(res, a.json, res["snapshot_id"])
    return 0


def cmd_thaw(a: argparse.Namespace) -> int:
    c = _client()
    req = {
        "snapshot_id": a.snapshot,
        "job_id": a.job_id,
        "nodes": a.nodes.split(",") if a.nodes else None,
    }
    res = _drive(c.stream("Thaw", req), Progress(a.json), "done")
    st = res["stats"]
    print(
        f"job {res['job_id']} thawed from {a.snapshot}: fetch+verify {st['fetch_s']:.2f}s, "
        f"restore {st['restore_s']:.2f}s",
        file=sys.stderr,
    )
    emit_result(res, a.json, res["job_id"])
    return 0


# --------------------------------------------------------------------------- queries
def cmd_jobs(a: argparse.Namespace) -> int:
    res = _client().call("Jobs")
    rows = [
        [
            j["job_id"],
            j["state"],
            str(len(j["ranks"])),
            ",".join(j["nodes"]),
            str(len(j["snapshots"])),
        ]
        for j in res["jobs"]
    ]
    emit_result(res, a.json, None, table(rows, ["JOB", "STATE", "RANKS", "NODES", "SNAPSHOTS"]))
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
    return "\n".join(lines)


def cmd_status(a: argparse.Namespace) -> int:
    c = _client()
    if a.job_id is not None:
        st = c.call("Status", {"job_id": a.job_id})
        emit_result(st, a.json, None, _status_text(st))
        return 0
    res = {"coordinator": c.call("Ping"), **c.call("Nodes")}
    emit_result(res, a.json, None, _services_text(res))
    return 0


def _resources_text(r: Msg) -> str:
    return (
        f"fds {r['fds']}, threads {r['threads']}, children {r['children']}, "
        f"zombies {r['zombies']}, rss {human_bytes(r['rss_bytes'])}"
    )


def _services_text(res: Msg) -> str:
    co = res["coordinator"]
    head = f"coordinator pid {co['pid']}, store {co['store']}"
    lines = [f"{head}: {_resources_text(co['resources'])}"]
    for n in res["nodes"]:
        if "error" in n:
            lines.append(f"  node {n['name']} ({n['address']}): not answering: {n['error']}")
            continue
        jobs = ", ".join(n.get("running_jobs", [])) or "none"
        lines.append(
            f"  node {n['name']} ({n['address']}, pid {n['pid']}): "
            f"{_resources_text(n['resources'])}; running jobs: {jobs}"
        )
    return "\n".join(lines)


def cmd_wait(a: argparse.Namespace) -> int:
    c = _client()
    deadline = None if a.timeout is None else time.monotonic() + a.timeout
    while True:
        left = 30.0 if deadline is None else max(0.0, min(30.0, deadline - time.monotonic()))
        st = c.call("Wait", {"job_id": a.job_id, "timeout": left}, timeout=left + 30)
        if st["state"] in TERMINAL or (deadline is not None and time.monotonic() >= deadline):
            break
    emit_result(st, a.json, None, _status_text(st))
    if st["state"] not in TERMINAL:
        return 124
    return int(st.get("exit_code") or 0)


def cmd_logs(a: argparse.Namespace) -> int:
    c = _client()
    req = {"job_id": a.job_id, "rank": a.rank, "follow": a.follow, "offset": 0}
    if a.follow and a.rank is None:
        raise errors.InvalidArgument("--follow needs --rank", "pick one rank to follow")
    for ev in c.stream("Logs", req):
        sys.stdout.write(ev["data"])
        sys.stdout.flush()
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    st = _client().call("Cancel", {"job_id": a.job_id})
    emit_result(st, a.json, None, _status_text(st))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    res = _client().call("List", {"job_id": a.job})
    rows = [
        [
            s["snapshot_id"],
            s["job_id"] or "",
            str(s["ranks"]),
            human_bytes(s["stored_bytes"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(s["created"])),
        ]
        for s in res["snapshots"]
    ]
    emit_result(res, a.json, None, table(rows, ["SNAPSHOT", "JOB", "RANKS", "STORED", "CREATED"]))
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    res = _client().call("Show", {"snapshot_id": a.snapshot})
    emit_result(res, a.json, None, json.dumps(res, indent=2, default=str))
    return 0


def cmd_delete(a: argparse.Namespace) -> int:
    res = _client().call("Delete", {"snapshot_id": a.snapshot})
    emit_result(res, a.json, None, f"deleted {a.snapshot}")
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


# --------------------------------------------------------------------------- services
def cmd_coordinator(a: argparse.Namespace) -> int:
    from snapshotter import daemon

    argv = ["coordinator", "--listen", a.listen, "--agent-ttl", str(a.agent_ttl)]
    return daemon.main(argv + (["--store", a.store] if a.store else []))


def cmd_agent(a: argparse.Namespace) -> int:
    from snapshotter import daemon

    argv = ["agent", "--listen", a.listen, "--coordinator", a.coordinator,
            "--heartbeat", str(a.heartbeat), "--freeze-lease", str(a.freeze_lease)]  # fmt: skip
    argv += ["--name", a.name] if a.name else []
    argv += ["--store", a.store] if a.store else []
    for kv in a.env:
        argv += ["--env", kv]
    return daemon.main(argv)


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    p = argparse.ArgumentParser(
        prog="snapshotter",
        description="Transparent freeze/thaw of running PyTorch jobs.",
    )
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
    r.add_argument("--detach", "-d", action="store_true")
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
    co = add("coordinator", cmd_coordinator, "serve a coordinator (multi-node deployments)")
    co.add_argument("--listen", default="0.0.0.0:7070", help="host:port to serve on")
    co.add_argument("--store", default=None, help="snapshot store URL ($SNAPSHOTTER_STORE)")
    co.add_argument("--agent-ttl", type=float, default=15.0,
                    help="seconds without a heartbeat before a node is not placed on")
    ag = add("agent", cmd_agent, "serve this node's agent (multi-node deployments)")
    ag.add_argument("--listen", required=True,
                    help="NODE_IP:PORT; ranks of this node use NODE_IP and its interface")
    ag.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    ag.add_argument("--name", default=None, help="node name (default: the hostname)")
    ag.add_argument("--store", default=None, help="snapshot store URL ($SNAPSHOTTER_STORE)")
    ag.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="network setting for this node's ranks (wins over the job's, also "
                    "after a thaw onto this node)")
    ag.add_argument("--heartbeat", type=float, default=2.0)
    ag.add_argument("--freeze-lease", type=float, default=60.0,
                    help="seconds without word from the coordinator before a freeze is undone")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a))
    except errors.SnapshotterError as e:
        if getattr(a, "json", False):
            print(json.dumps({"error": e.to_dict()}))
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
