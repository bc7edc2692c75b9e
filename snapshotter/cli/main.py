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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from snapshotter import __version__, errors
from snapshotter.cli import checkpoints as checkpoints_cli
from snapshotter.cli import failures, preempt, progress, services, supervise, torchrun
from snapshotter.cli import gc as gc_cli
from snapshotter.cli import keys as keys_cli
from snapshotter.cli import tenants as tenants_cli
from snapshotter.cli.connect import coordinator, stop_embedded
from snapshotter.cli.output import Msg, emit_result, human_bytes, table
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


def cmd_run(a: argparse.Namespace) -> int:
    for note in torchrun.check(a):
        print(f"note: {note}", file=sys.stderr)
    routing = torchrun.output(a)
    job_id = a.job_id or a.rdzv_id or ""
    if job_id:
        validate_job_id(job_id)
    script = a.script if a.module else str(Path(a.script))
    if not a.module and not Path(script).exists():
        raise errors.InvalidArgument(f"script {script!r} not found", "check the path")
    nproc_count, nproc_kind = torchrun.nproc_request(str(a.nproc_per_node))
    req = pb.RunRequest(
        job_id=job_id,
        script=script,
        script_args=a.script_args,
        module=a.module,
        python=sys.executable,
        cwd=os.getcwd(),
        env=dict(os.environ),
        nnodes=_nnodes(a.nnodes),
        nproc_per_node=nproc_count,
        nproc_kind=nproc_kind,
        nodes=a.nodes.split(",") if a.nodes else [],
        recovery=supervise.recovery_from_flags(a),
        tenant=a.tenant or "",
        provider_opt_out=a.no_provider_snapshots,
    )
    req.policy.CopyFrom(supervise.policy_from_flags(a)[0])
    if a.role != "default":
        req.env["SNAPSHOTTER_ROLE"] = a.role
    preempt_on = preempt.signal_names(a.preempt_signal)
    node = _per_node_launch(a, job_id, req.nnodes)
    c = _client()
    # The handlers are in place before the job starts: a Ctrl-C or a notice that comes while
    # it starts still stops it (or freezes it) once it runs.
    with preempt.notices(preempt_on) as told:
        if node:
            st = _join(c, job_id, req.nnodes, node, told.stop)
        else:
            st = _start(c, a, req)
        job = st.job_id
        if a.detach:
            emit_result(plain(st), a.json, job, f"job {job}: {len(st.ranks)} ranks")
            return 0
        # The per-node idiom: each node's launch shows its own node's ranks, as torchrun does.
        only = _node_ranks(st, node if node else 0) if a.node_rank is not None else None
        st = _attach(c, job, told.stop, routing, only)
        if st.state not in TERMINAL and told.preempted and node:
            # A scheduler signals every node's launch: node 0's freezes the job, the others
            # follow it to its end (a second freeze, or a fallback's cancel, must not race it).
            print(f"node {node}: preemption notice; node 0's launch freezes job {job}",
                  file=sys.stderr)  # fmt: skip
            st = _attach(c, job, None, routing, only)
        elif st.state not in TERMINAL and told.preempted:
            return preempt.preempt(c, job, a.preempt_grace, a.json)
        if st.state not in TERMINAL and told.interrupts:
            return _interrupted(c, job, told)
    if st.state == "FROZEN":
        print(f"job {job} was frozen and stopped; thaw it with `snapshotter thaw`", file=sys.stderr)
    if not a.json and (text := failures.summary(plain(st))):
        print(text, file=sys.stderr)
    emit_result(plain(st), a.json, None)
    return st.exit_code if st.HasField("exit_code") else 0


def _start(c: Client, a: argparse.Namespace, req: pb.RunRequest) -> pb.JobStatus:
    """The job started, or with --resume thawed from its newest snapshot."""
    resume_from = _resume_point(c, a.resume, req.job_id)
    if not resume_from:
        st = c.stub.Run(req, timeout=180)
        print(f"started job {st.job_id}", file=sys.stderr)
        return st
    print(f"resuming job {req.job_id} from its newest snapshot {resume_from}", file=sys.stderr)
    thaw = pb.ThawRequest(snapshot_id=resume_from, nodes=req.nodes)
    thawed = _drive(c.stub.Thaw(thaw), a.json)
    return c.stub.Status(common_pb2.JobRef(job_id=thawed["job_id"]), timeout=30)


def _per_node_launch(a: argparse.Namespace, job_id: str, nnodes: int) -> int:
    """torchrun's per-node idiom (`srun torchrun --nnodes N --node-rank $SLURM_NODEID
    --rdzv-id ID ...`): the node rank of a launch that joins the job node 0 starts (0: this
    launch starts it)."""
    k = a.node_rank or 0
    if k == 0:
        return 0
    if not job_id:
        raise errors.InvalidArgument(
            f"--node-rank {k}: a node's launch finds its job by id",
            "give every node's launch the same --rdzv-id",
        )
    if k >= nnodes:
        raise errors.InvalidArgument(f"--node-rank {k} is not below --nnodes {nnodes}",
                                     f"node ranks are 0..{nnodes - 1}")  # fmt: skip
    if a.resume:
        raise errors.InvalidArgument(
            "--resume is node 0's to do: it thaws the whole job", "give --resume to node 0 only"
        )
    return k


def _join(c: Client, job_id: str, nnodes: int, node: int, stop: threading.Event) -> pb.JobStatus:
    """Wait (torchrun's join timeout, 600 s) for node 0's launch to start the job, then follow
    it."""
    deadline = time.monotonic() + float(os.environ.get("SNAPSHOTTER_JOIN_TIMEOUT_S", "600"))
    print(f"node {node}: waiting for node 0 to start job {job_id}", file=sys.stderr)
    while True:
        try:
            st = c.stub.Status(common_pb2.JobRef(job_id=job_id), timeout=30)
            break
        except errors.JobNotFound:
            pass
        if stop.wait(0.5):
            raise KeyboardInterrupt  # main's exit 130: there is no job of this launch to stop
        if time.monotonic() > deadline:
            raise errors.InvalidArgument(
                f"node {node}: job {job_id} was not started by node 0's launch in time",
                "start node 0's launch with the same --rdzv-id and --nnodes",
            )
    if st.nnodes != nnodes:
        raise errors.InvalidArgument(
            f"job {job_id} has {st.nnodes} node(s), this launch says --nnodes {nnodes}",
            "give every node's launch the same --nnodes (or another --rdzv-id)",
        )
    print(f"node {node}: joined job {job_id}", file=sys.stderr)
    return st  # type: ignore[no-any-return]


def _node_ranks(st: pb.JobStatus, node: int) -> set[int]:
    n = st.nproc_per_node
    return set(range(node * n, (node + 1) * n))


def _resume_point(c: Client, resume: bool, job_id: str) -> str:
    """With --resume: the job's newest committed snapshot ("" when it has none: a first start
    or a requeue of a job that was never frozen)."""
    if not resume:
        return ""
    if not job_id:
        raise errors.InvalidArgument(
            "--resume needs the job's id to find its snapshots",
            "give --job-id (or --rdzv-id), the same on every start of the job",
        )
    try:
        running = c.stub.Status(common_pb2.JobRef(job_id=job_id), timeout=30).state
    except errors.JobNotFound:
        running = ""
    if running and running not in TERMINAL:
        raise errors.InvalidArgument(
            f"job {job_id} is {running}: it is not resumed twice",
            f"attach with `snapshotter logs {job_id} --follow`, or stop it first",
        )
    return preempt.newest_snapshot(c, job_id)


def _interrupted(c: Client, job: str, told: preempt.Notices) -> int:
    """Ctrl-C: the job is stopped, as torchrun stops its workers; a second Ctrl-C stops
    waiting for that."""
    print(f"\ninterrupted: stopping job {job} (Ctrl-C again to stop waiting)", file=sys.stderr)
    c.stub.Cancel(common_pb2.JobRef(job_id=job), timeout=60)
    told.stop.clear()
    deadline = time.monotonic() + 60
    while not told.again.is_set() and time.monotonic() < deadline:
        st = c.stub.Status(common_pb2.JobRef(job_id=job), timeout=30)
        if st.state in TERMINAL:
            print(f"job {job} stopped ({st.state})", file=sys.stderr)
            break
        told.again.wait(0.5)
    else:
        print(f"job {job} is stopping; `snapshotter status {job}` shows when it has",
              file=sys.stderr)  # fmt: skip
    return 130


def _attach(
    c: Client,
    job: str,
    stop: threading.Event | None = None,
    routing: torchrun.Output | None = None,
    only: set[int] | None = None,
) -> pb.JobStatus:
    """Stream the ranks' output while the job runs, like torchrun does (bytes as they are; to
    the console and --log-dir as `routing` says; `only` these ranks), until it ends or `stop`
    is set."""
    offsets: dict[int, int] = {}
    out = sys.stdout.buffer
    routing = routing or torchrun.Output(None, {}, {}, None)
    files = RankFiles(routing.log_dir, job)
    try:
        while True:
            st = c.stub.Status(common_pb2.JobRef(job_id=job), timeout=30)
            done = st.state in TERMINAL
            for r in st.ranks:
                if only is not None and r.rank not in only:
                    continue
                local = r.rank % max(st.nproc_per_node, 1)
                for data in _read_log(c, job, r.rank, offsets):
                    if routing.console(local):
                        out.write(data)
                    if routing.to_file(local):
                        files.write(r.rank, data)
            out.flush()
            if done or (stop is not None and stop.is_set()):
                return st  # type: ignore[no-any-return]
            if stop is not None:
                stop.wait(0.5)
            else:
                time.sleep(0.5)
    finally:
        files.close()


class RankFiles:
    """--log-dir: each rank's output in LOG_DIR/JOB/attempt_0/RANK/stdout.log, torchrun's
    layout (stdout and stderr together: a rank's output is one stream here)."""

    def __init__(self, log_dir: str | None, job: str) -> None:
        self.root = Path(log_dir) / job / "attempt_0" if log_dir else None
        self._open: dict[int, Any] = {}

    def write(self, rank: int, data: bytes) -> None:
        if self.root is None:
            return
        f = self._open.get(rank)
        if f is None:
            d = self.root / str(rank)
            try:
                d.mkdir(parents=True, exist_ok=True)
                f = self._open[rank] = open(d / "stdout.log", "ab")  # noqa: SIM115
            except OSError as e:
                raise errors.InvalidArgument(
                    f"--log-dir: cannot write {d}: {e.strerror}", "give a writable directory"
                ) from e
        f.write(data)
        f.flush()

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


# --------------------------------------------------------------------------- freeze / thaw
def _event(ev: Any) -> Msg:
    """A stream event as one flat line: {"event": phase|progress|done, ...its fields}."""
    kind = ev.WhichOneof("event")
    return {"event": kind, **plain(getattr(ev, kind))}


def _drive(stream: Iterable[Any], as_json: bool) -> Msg:
    """Show an operation's events as they come (progress.py); its result."""
    result = progress.drive(stream, progress.view(as_json), _event)
    if result is None:
        raise errors.Internal("the operation ended without a result", "see the daemon log")
    return result


def cmd_freeze(a: argparse.Namespace) -> int:
    c = _client()
    req = pb.FreezeRequest(job_id=a.job_id, stop=a.stop)
    if a.quiesce_timeout is not None:
        req.quiesce_timeout_s = a.quiesce_timeout
    res = _drive(c.stub.Freeze(req), a.json)
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
    res = _drive(c.stub.Thaw(req), a.json)
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
    res = _drive(c.stub.Migrate(req), a.json)
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


def cmd_weights(a: argparse.Namespace) -> int:
    res = _client().stub.Weights(common_pb2.Empty(), timeout=60)
    rows = [[c.channel, c.tenant, str(c.version), f"{c.lineage}@{c.publisher}",
             human_bytes(c.bytes), ",".join(c.holders) or "-", ",".join(c.failed) or "-"]
            for c in res.channels]  # fmt: skip
    text = table(rows, ["CHANNEL", "TENANT", "VERSION", "PUBLISHED BY", "SIZE", "HELD ON",
                        "FAILED ON"])  # fmt: skip
    emit_result(plain(res), a.json, None, text if rows else "no weights published")
    return 0


AUDIT_FAILED_EXIT = 18  # the audit ran and found a failed or degraded node or link


def cmd_audit(a: argparse.Namespace) -> int:
    nodes = [n for n in (a.nodes or "").split(",") if n]
    req = coordinator_pb2.AuditRequest(nodes=nodes, link_bytes=int(a.link_mib * (1 << 20)),
                                       storage_bytes=int(a.storage_mib * (1 << 20)))  # fmt: skip
    res = _client().stub.Audit(req, timeout=3600)
    emit_result(plain(res), a.json, None, _audit_text(res))
    return 0 if res.passed else AUDIT_FAILED_EXIT


def cmd_top(a: argparse.Namespace) -> int:
    req = coordinator_pb2.TopRequest(job_id=a.job_id, hang_s=a.hang_after)
    while True:
        res = _client().stub.Top(req, timeout=60)
        emit_result(plain(res), a.json, None, _top_text(res))
        if not a.watch:
            return 0
        time.sleep(a.watch)
        if not a.json:
            print()


def _top_text(res: Any) -> str:
    def ms(s: float) -> str:
        return f"{s * 1000:.1f}" if s else "-"

    rows = [[str(r.rank), r.node, r.proc_state or "-", str(r.steps), ms(r.step_s), ms(r.wait_s),
             ms(r.busy_s), f"{r.last_share:.0%}" if res.aligned else "-",
             f"{r.in_flight_s:.1f}" if r.in_flight_s else "-",
             "" if r.answered else "no answer"] for r in res.ranks]  # fmt: skip
    text = table(rows, ["RANK", "NODE", "STATE", "STEPS", "STEP MS", "WAIT MS", "BUSY MS",
                        "LAST IN", "IN FLIGHT S", ""])  # fmt: skip
    if res.links:
        text += "\n\n" + table([[f"{x.a} <-> {x.b}", f"{x.rtt_ms:.2f}", human_bytes(x.bytes_sent),
                                 human_bytes(x.bytes_retrans)] for x in res.links],
                               ["LINK", "RTT MS", "SENT", "RETRANSMITTED"])  # fmt: skip
    findings = list(res.findings) or ["nothing stands out: no straggler, slow link or hang"]
    return text + "\n\n" + "\n".join(findings)


def _audit_text(res: Any) -> str:
    def why(x: Any) -> str:
        return "; ".join(x.why) or "-"

    nodes = table([[n.node, n.status.upper(), why(n)] for n in res.nodes],
                  ["NODE", "STATUS", "WHY"])  # fmt: skip
    ports = table([[i.node, str(i.plane), f"{i.rtt_ms:.2f}", f"{i.mbps:.1f}",
                    f"{i.retrans:.2%}", i.status.upper(), why(i)] for i in res.interfaces],
                  ["NODE", "PLANE", "RTT MS", "MB/S", "RETRANS", "STATUS", "WHY"])  # fmt: skip
    pairs = table([[f"{x.a}->{x.b}", str(x.plane), f"{x.rtt_ms:.2f}", f"{x.mbps:.1f}",
                    f"{x.retrans:.2%}", x.status.upper()] for x in res.links],
                  ["PAIR", "PLANE", "RTT MS", "MB/S", "RETRANS", "STATUS"])  # fmt: skip
    verdict = "passed" if res.passed else "FAILED"
    return (f"{nodes}\n\nlinks (each node's interface, the median of its pairs):\n{ports}\n\n"
            f"pairs:\n{pairs}\n\naudit {verdict}: {len(res.nodes)} node(s), "
            f"{len(res.links)} probe(s) in {res.rounds} round(s), {res.seconds:.1f} s")


def _status_text(st: Msg) -> str:
    lines = [
        f"job {st['job_id']}: {st['state']}  ({st['nnodes']} node(s) x "
        f"{st['nproc_per_node']} rank(s); {st['script']})"
    ]
    for r in st["ranks"]:
        code = "" if r.get("exit_code") is None else f" exit {r['exit_code']}"
        cause = (r.get("error") or "").rstrip().splitlines()
        why = f" ({'root cause: ' if r.get('failed_first') else ''}{cause[-1]})" if cause else ""
        lines.append(f"  rank {r['rank']}: pid {r['pid']}{code}{why}")
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


def cmd_nodes(a: argparse.Namespace) -> int:
    res = plain(_client().stub.Nodes(common_pb2.Empty(), timeout=60))
    rows = [_node_row(n) for n in res["nodes"]]
    text = table(rows, ["NODE", "ADDRESS", "HEALTH", "HEARTBEAT", "CPUS", "GPUS", "JOBS",
                        "LINKS"])
    emit_result(res, a.json, None, text if rows else "no agent has registered")
    return 0


def _node_row(n: Msg) -> list[str]:
    """One agent: its health (live; not answering; GPU faults), its last heartbeat's age, the
    CPUs and GPUs it counts for --nproc-per-node cpu|gpu, its running jobs and its data
    links."""
    ag = n.get("agent") or {}
    fatal = [f for f in ag.get("gpu_faults", []) if f.get("fatal")]
    if not n.get("live"):
        health = "LOST"
    elif n.get("error"):
        health = "NOT ANSWERING"
    elif fatal:
        health = f"GPU FAULT ({fatal[-1]['kind']} {fatal[-1]['code']})"
    else:
        health = "ok"
    if n.get("draining"):
        health += ", DRAINING"
    age = n.get("heartbeat_age_s")
    links = ",".join(
        x["name"] + ("" if x["up"] else "(down)")
        + ("(drained)" if x["name"] in n.get("drained_links", []) else "")
        for x in n.get("links", [])
    )  # fmt: skip
    return [n["name"], n["address"], health, "-" if age is None else f"{age:.1f}s ago",
            str(ag.get("cpus") or "-"), str(ag.get("gpus", 0)) if ag else "-",
            ",".join(ag.get("running_jobs", [])) or "-", links or "-"]  # fmt: skip


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
    """A job's rank output: every rank's lines prefixed `[rankN]: ` (torchrun's prefix), or
    one rank's as they are; --tail N: the last N lines of each; --follow: then new output as it
    comes until the job ends (Ctrl-C stops following)."""
    c = _client()
    if a.tail is not None and a.tail < 0:
        raise errors.InvalidArgument(f"--tail {a.tail} is negative", "give a number of lines")
    st = c.stub.Status(common_pb2.JobRef(job_id=a.job_id), timeout=30)
    ranks = [r.rank for r in st.ranks] if a.rank is None else [a.rank]
    out = RankLines(sys.stdout.buffer, prefixed=a.rank is None)
    offsets: dict[int, int] = {}
    for r in ranks:
        data = b"".join(_read_log(c, a.job_id, r, offsets))
        out.write(r, data if a.tail is None else _last_lines(data, a.tail))
    while a.follow and st.state not in TERMINAL:
        time.sleep(0.5)
        st = c.stub.Status(common_pb2.JobRef(job_id=a.job_id), timeout=30)
        for r in ranks:
            for data in _read_log(c, a.job_id, r, offsets):
                out.write(r, data)
    out.close()
    return 0


def _read_log(c: Client, job: str, rank: int, offsets: dict[int, int]) -> Iterator[bytes]:
    req = common_pb2.LogsRequest(job_id=job, rank=rank, offset=offsets.get(rank, 0))
    for chunk in c.stub.Logs(req):
        offsets[rank] = chunk.offset + len(chunk.data)
        yield chunk.data


def _last_lines(data: bytes, n: int) -> bytes:
    if n == 0:
        return b""
    lines = data.splitlines(keepends=True)
    return b"".join(lines[-n:])


class RankLines:
    """Ranks' output, whole lines at a time, each prefixed with its rank when asked (a partial
    line waits for its end, or for close)."""

    def __init__(self, out: Any, prefixed: bool) -> None:
        self.out = out
        self.prefixed = prefixed
        self._partial: dict[int, bytes] = {}

    def write(self, rank: int, data: bytes) -> None:
        if not self.prefixed:
            self.out.write(data)
            self.out.flush()
            return
        buf = self._partial.pop(rank, b"") + data
        *lines, rest = buf.split(b"\n")
        for line in lines:
            self.out.write(b"[rank%d]: %s\n" % (rank, line))
        if rest:
            self._partial[rank] = rest
        self.out.flush()

    def close(self) -> None:
        for rank, rest in sorted(self._partial.items()):
            self.out.write(b"[rank%d]: %s\n" % (rank, rest))
        self._partial.clear()
        self.out.flush()


def cmd_cancel(a: argparse.Namespace) -> int:
    st = plain(_client().stub.Cancel(common_pb2.JobRef(job_id=a.job_id), timeout=120))
    emit_result(st, a.json, None, _status_text(st))
    return 0


def cmd_list(a: argparse.Namespace) -> int:
    if a.checkpoints:
        return checkpoints_cli.list_checkpoints(a)
    if a.store:
        raise errors.InvalidArgument("--store goes with --checkpoints",
                                     "snapshots are listed through the coordinator")  # fmt: skip
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
    from snapshotter.cli import timeline

    if a.timeline and a.json:
        raise errors.InvalidArgument(
            "--timeline draws text and --json prints one JSON document",
            "use --json alone (its stats.spans), or --trace FILE for a machine-readable timeline",
        )
    detail = _client().stub.ShowSnapshot(pb.SnapshotRef(snapshot_id=a.snapshot), timeout=60)
    spans = detail.summary.stats.spans
    if (a.timeline or a.trace) and not spans:
        raise errors.InvalidArgument(
            f"snapshot {a.snapshot} has no timeline: it was committed by a coordinator from "
            "before freezes recorded where their time went",
            "freeze the job again and show that snapshot (`snapshotter list` names it)",
        )
    if a.trace:
        try:
            Path(a.trace).write_text(json.dumps(timeline.chrome_trace(spans)) + "\n")
        except OSError as e:
            raise errors.InvalidArgument(f"cannot write --trace {a.trace}: {e}",
                                         "give a path in a writable directory") from e  # fmt: skip
        print(f"trace written to {a.trace}: open it in https://ui.perfetto.dev or "
              "chrome://tracing", file=sys.stderr)  # fmt: skip
    if a.timeline:
        sys.stdout.write(timeline.timeline_text(spans, 100))
        return 0
    d = plain(detail)
    res = {**d.pop("summary"), **d}
    text = {**res, "stats": {k: v for k, v in res["stats"].items() if k != "spans"}}
    emit_result(res, a.json, None, json.dumps(text, indent=2, default=str))
    return 0


def cmd_delete(a: argparse.Namespace) -> int:
    if a.checkpoint:
        return checkpoints_cli.delete_checkpoint(a)
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
    torchrun.add_flags(r)
    r.add_argument("--nodes", default=None, help="comma-separated agent names to place on")
    r.add_argument("--job-id", default=None)
    r.add_argument("--tenant", default=None,
                   help="whose job it is (default: default): its snapshots are sealed under "
                   "this tenant's data keys")  # fmt: skip
    r.add_argument("--no-provider-snapshots", action="store_true",
                   help="the provider (a caller of no tenant) may not freeze this job; its "
                   "tenant's freezes and its own policy still may")  # fmt: skip
    r.add_argument("--detach", "-d", action="store_true")
    r.add_argument("--preempt-signal", action="append", default=None, metavar="SIG",
                   help="a signal that means: freeze the job and stop (repeatable; default "
                   "TERM; USR1 for Slurm's --signal=B:USR1@120)")  # fmt: skip
    r.add_argument("--resume", action="store_true",
                   help="thaw the job (--job-id) from its newest committed snapshot if it has "
                   "one, else start it: what a requeued batch job runs")  # fmt: skip
    r.add_argument(
        "--preempt-grace",
        type=float,
        default=30.0,
        help="on a --preempt-signal: seconds to freeze and stop the job in (default 30)",
    )
    supervise.add_policy_flags(r)
    supervise.add_recovery_flags(r)
    r.add_argument("script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    torchrun.env_defaults(r, os.environ)

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
    add("nodes", cmd_nodes, "list the agents: their health, last heartbeat, jobs and links")
    add("weights", cmd_weights, "list weight-push channels: newest version, publisher, holders")
    au = add("audit", cmd_audit, "check every node and every link between nodes (acceptance): "
             f"exit 0 when all are healthy, {AUDIT_FAILED_EXIT} otherwise")
    au.add_argument("--nodes", default=None, help="these nodes only (comma-separated)")
    au.add_argument("--link-mib", type=float, default=32.0, help="sent per link probe")
    au.add_argument("--storage-mib", type=float, default=8.0,
                    help="written to and read from the store per node")
    tp = add("top", cmd_top, "a running job's step time and collective waits per rank, and the "
             "slowest rank, node and link, or the rank a hang waits on")
    tp.add_argument("job_id")
    tp.add_argument("--watch", type=float, default=0.0, metavar="S",
                    help="sample again every S seconds until interrupted")
    tp.add_argument("--hang-after", type=float, default=0.0, metavar="S",
                    help="a collective in flight this long is a hang (default 10)")
    s = add("status", cmd_status, "show a job, or without one the services and their resources")
    s.add_argument("job_id", nargs="?", default=None)
    w = add("wait", cmd_wait, "wait until a job ends")
    w.add_argument("job_id")
    w.add_argument("--timeout", type=float, default=None)
    lg = add("logs", cmd_logs, "show rank output")
    lg.add_argument("job_id")
    lg.add_argument("--rank", type=int, default=None)
    lg.add_argument("--follow", "-f", action="store_true",
                    help="then new output as it comes, until the job ends")
    lg.add_argument("--tail", type=int, default=None, metavar="N",
                    help="only the last N lines of each rank's output so far")
    cn = add("cancel", cmd_cancel, "stop a job")
    cn.add_argument("job_id")
    ls = add("list", cmd_list, "list committed snapshots")
    ls.add_argument("--job", default=None)
    ls.add_argument("--checkpoints", action="store_true",
                    help="list application checkpoints (snapshotter.checkpoint) instead")
    ls.add_argument("--store", default=None, metavar="URL",
                    help="with --checkpoints: the store to read ($SNAPSHOTTER_STORE, else the "
                    "embedded daemon's)")
    sh = add("show", cmd_show, "describe a snapshot")
    sh.add_argument("snapshot")
    sh.add_argument("--timeline", action="store_true",
                    help="draw where the freeze's time went, per node and rank")
    sh.add_argument("--trace", metavar="FILE", default=None,
                    help="write that timeline as a Chrome trace (ui.perfetto.dev opens it)")
    de = add("delete", cmd_delete, "delete a snapshot")
    de.add_argument("snapshot", help="a snapshot id, or with --checkpoint a checkpoint name")
    de.add_argument("--checkpoint", action="store_true",
                    help="delete an application checkpoint (its manifest and parts)")
    de.add_argument("--store", default=None, metavar="URL",
                    help="with --checkpoint: the store ($SNAPSHOTTER_STORE, else the embedded "
                    "daemon's)")
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
