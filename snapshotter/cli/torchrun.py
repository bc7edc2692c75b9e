"""torchrun's flags on `snapshotter run`, so a torchrun command line works when `torchrun` is
replaced by `snapshotter run`. Each of torchrun's flags is one of:

- taken with torchrun's meaning (sizes, ids, restarts, modules, logs, role);
- taken with a note where snapshotter itself does what it sets: the rendezvous is
  snapshotter's (it must outlive a thaw), so its address, backend options and timeouts are not
  the job's to choose;
- refused by name with the reason, when honouring it would break freezing or it has no
  counterpart here.

Like torchrun, every flag's default comes from PET_<NAME> in the environment (what Kubeflow's
PyTorchJob sets), and --standalone, -m, --no-python, --run-path read PET_* as 0/1.
Decisions here are pure: `check` maps parsed flags to notes or an error; no I/O.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.launch.spec import NPROC_KINDS, nproc_for

# What snapshotter does itself, so the flag is taken and has no further effect.
NOTED = {
    "master_addr": "the rendezvous server is snapshotter's (it survives a thaw)",
    "master_port": "the rendezvous server is snapshotter's (it survives a thaw)",
    "rdzv_endpoint": "the rendezvous server is snapshotter's (it survives a thaw)",
    "rdzv_conf": "snapshotter's rendezvous has no timeouts to tune: ranks join as they start",
    "local_addr": "each node's agent names the address its ranks use (agent --listen/--link)",
    "monitor_interval": "the agents watch their ranks continuously",
    "shutdown_timeout": "a stopped job's ranks are ended at once (freeze first to keep them)",
}
# Given a value other than torchrun's default, these are refused: (why, what to do instead).
REFUSED = {
    "logs_specs": ("a LogsSpecs plugin runs inside torchrun's agent, which snapshotter replaces",
                   "use --log-dir with --tee/--redirects"),
    "duplicate_stdout_filters": ("ranks' stdout and stderr are one stream in snapshotter",
                                 "use --log-dir with --tee 3"),
    "duplicate_stderr_filters": ("ranks' stdout and stderr are one stream in snapshotter",
                                 "use --log-dir with --tee 3"),
    "numa_binding": ("ranks keep their agent's CPU and memory placement, which a thaw onto "
                     "another node could not honour", "bind inside the job (os.sched_setaffinity)"),
    "virtual_local_rank": ("every rank sees its real LOCAL_RANK: a thaw maps it to the devices "
                           "of the node it lands on", "drop --virtual-local-rank"),
    "signals_to_handle": ("the signals a run takes are its own: --preempt-signal freezes, "
                          "Ctrl-C stops", "use --preempt-signal"),
    "event_log_handler": ("torchrun's event log has no counterpart; `snapshotter events JOB` "
                          "lists what happened to a job", "drop --event-log-handler"),
    "no_python": ("ranks run through the Python bootstrap that makes them freezable",
                  "run a Python script or module"),
}  # fmt: skip
TORCHRUN_DEFAULTS = {
    "logs_specs": None, "duplicate_stdout_filters": None, "duplicate_stderr_filters": None,
    "numa_binding": None, "virtual_local_rank": False,
    "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "event_log_handler": "null",
    "no_python": False,
}  # fmt: skip
RDZV_BACKENDS = ("c10d", "static")  # torchrun's own; snapshotter's rendezvous stands in for both
STREAMS = {"0": "none", "1": "stdout", "2": "stderr", "3": "both"}


def _flag(p: argparse._ActionsContainer, dest: str, *names: str, **kw: object) -> None:
    """One torchrun flag, in both of torchrun's spellings (--a-b and --a_b)."""
    spellings = [*names]
    for n in names:
        if n.startswith("--") and "-" in n[2:]:
            spellings.append("--" + n[2:].replace("-", "_"))
    p.add_argument(*spellings, dest=dest, **kw)  # type: ignore[arg-type]


def add_flags(r: argparse.ArgumentParser) -> None:
    """Every flag of torchrun, on the `run` parser."""
    g = r.add_argument_group("torchrun's flags (PET_<NAME> sets their defaults)")
    _flag(g, "nproc_per_node", "--nproc-per-node", default="1",
          help="ranks per node: a number, or auto|cpu|gpu counted as torchrun does")
    _flag(g, "nnodes", "--nnodes", default="1", help="nodes (MIN:MAX only with MIN == MAX)")
    _flag(g, "node_rank", "--node-rank", type=int, default=None,
          help="with --nnodes N and a shared --rdzv-id, each node's launch joins one job: node "
          "0 starts it, the others follow it (their node's ranks' output, its exit status)")
    _flag(g, "rdzv_id", "--rdzv-id", default=None, help="the job id (as --job-id)")
    _flag(g, "rdzv_backend", "--rdzv-backend", default="static",
          help=f"{' or '.join(RDZV_BACKENDS)}: snapshotter's rendezvous serves either")
    _flag(g, "rdzv_endpoint", "--rdzv-endpoint", default="", help=NOTED["rdzv_endpoint"])
    _flag(g, "rdzv_conf", "--rdzv-conf", default="", help=NOTED["rdzv_conf"])
    _flag(g, "master_addr", "--master-addr", default=None, help=NOTED["master_addr"])
    _flag(g, "master_port", "--master-port", type=int, default=None, help=NOTED["master_port"])
    _flag(g, "local_addr", "--local-addr", default=None, help=NOTED["local_addr"])
    g.add_argument("--standalone", action="store_true", help="one node (the default here)")
    _flag(g, "max_restarts", "--max-restarts", type=int, default=0,
          help="recover by itself at most N times (--recover auto --max-recoveries N)")
    _flag(g, "monitor_interval", "--monitor-interval", type=float, default=0.1,
          help=NOTED["monitor_interval"])
    _flag(g, "start_method", "--start-method", default="spawn",
          choices=["spawn", "fork", "forkserver"],
          help="ranks are always started as new processes (torchrun too, for a script)")
    g.add_argument("--role", default="default", help="the ranks' ROLE_NAME")
    g.add_argument("-m", "--module", action="store_true", help="run the script as a module")
    _flag(g, "no_python", "--no-python", action="store_true", help=REFUSED["no_python"][0])
    _flag(g, "run_path", "--run-path", action="store_true",
          help="run the script by its path (what snapshotter always does)")
    _flag(g, "log_dir", "--log-dir", default=None,
          help="write ranks' output under LOG_DIR/JOB/attempt_0/RANK/stdout.log (with "
          "--tee or --redirects)")
    g.add_argument("-r", "--redirects", default="0",
                   help="3 (or RANK:3,...): those ranks' output goes to --log-dir only")
    g.add_argument("-t", "--tee", default="0",
                   help="3 (or RANK:3,...): those ranks' output goes to --log-dir and console")
    _flag(g, "local_ranks_filter", "--local-ranks-filter", default="",
          help="show only these local ranks' output on the console (e.g. 0,1)")
    for dest, flag in (("duplicate_stdout_filters", "--duplicate-stdout-filters"),
                       ("duplicate_stderr_filters", "--duplicate-stderr-filters"),
                       ("logs_specs", "--logs-specs"), ("numa_binding", "--numa-binding"),
                       ("signals_to_handle", "--signals-to-handle"),
                       ("event_log_handler", "--event-log-handler"),
                       ("shutdown_timeout", "--shutdown-timeout")):  # fmt: skip
        why = REFUSED[dest][0] if dest in REFUSED else NOTED[dest]
        _flag(g, dest, flag, default=TORCHRUN_DEFAULTS.get(dest), help=why)
    _flag(g, "virtual_local_rank", "--virtual-local-rank", action="store_true",
          help=REFUSED["virtual_local_rank"][0])


def env_defaults(r: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """PET_<DEST> as each flag's default, as torchrun reads it."""
    for action in r._actions:
        if not action.option_strings or action.dest in ("help", "json"):
            continue
        value = environ.get(f"PET_{action.dest.upper()}")
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes")
        else:
            action.default = value


@dataclass(frozen=True)
class Output:
    """Where each rank's output goes in a foreground run: `console(rank, local_rank)` and
    `to_file(rank, local_rank)`; files under `log_dir`."""

    log_dir: str | None
    redirects: Mapping[int, str]  # local rank (-1: every rank) -> none|both
    tees: Mapping[int, str]
    shown: frozenset[int] | None  # local ranks shown on the console (None: all)

    def _of(self, table: Mapping[int, str], local_rank: int) -> str:
        return table.get(local_rank, table.get(-1, "none"))

    def console(self, local_rank: int) -> bool:
        if self._of(self.redirects, local_rank) != "none":
            return False
        return self.shown is None or local_rank in self.shown

    def to_file(self, local_rank: int) -> bool:
        return "none" != self._of(self.redirects, local_rank) or (
            "none" != self._of(self.tees, local_rank)
        )


def _streams(flag: str, value: str) -> dict[int, str]:
    """torchrun's -r/-t value: 0-3 for every rank, or LOCAL_RANK:0-3,... Only 0 and 3 here:
    a rank's stdout and stderr are one stream."""
    out: dict[int, str] = {}
    parts = [value] if ":" not in value else value.split(",")
    for part in parts:
        rank_s, _, v = part.rpartition(":")
        try:
            rank = int(rank_s) if rank_s else -1
        except ValueError:
            rank = -2
        if rank < -1 or v.strip() not in STREAMS:
            raise errors.InvalidArgument(
                f"{flag} {value!r}: not 0-3 or LOCAL_RANK:0-3,...", f"e.g. {flag} 3 or {flag} 0:3"
            )
        kind = STREAMS[v.strip()]
        if kind in ("stdout", "stderr"):
            raise errors.InvalidArgument(
                f"{flag} {value!r}: a rank's stdout and stderr are one stream in snapshotter, "
                f"so {kind} alone cannot be split off",
                f"give {flag} 3 (both)",
            )
        out[rank] = kind
    return out


def output(a: argparse.Namespace) -> Output:
    """The output routing of a run's flags (an error names the flag that is wrong)."""
    redirects, tees = _streams("--redirects", str(a.redirects)), _streams("--tee", str(a.tee))
    shown: frozenset[int] | None = None
    if a.local_ranks_filter:
        try:
            shown = frozenset(int(x) for x in str(a.local_ranks_filter).split(",") if x.strip())
        except ValueError as e:
            raise errors.InvalidArgument(
                f"--local-ranks-filter {a.local_ranks_filter!r} is not a list of local ranks",
                "e.g. --local-ranks-filter 0,1",
            ) from e
    wants_files = any(v != "none" for v in (*redirects.values(), *tees.values()))
    if wants_files and not a.log_dir:
        raise errors.InvalidArgument(
            "--redirects/--tee write ranks' output to files: they need --log-dir",
            "add --log-dir DIR",
        )
    if a.detach and (wants_files or a.log_dir):
        raise errors.InvalidArgument(
            "--log-dir, --tee and --redirects are written by a foreground run, not --detach",
            "drop --detach, or read the output later with `snapshotter logs JOB`",
        )
    return Output(a.log_dir, redirects, tees, shown)


def check(a: argparse.Namespace) -> list[str]:
    """Refuses what cannot be honoured (by name, with the reason); returns a note for each
    flag given that snapshotter takes without further effect."""
    for dest, (why, instead) in REFUSED.items():
        if getattr(a, dest) not in (TORCHRUN_DEFAULTS[dest], [], ""):
            flag = "--" + dest.replace("_", "-")
            raise errors.InvalidArgument(f"{flag} is not supported: {why}", instead)
    if a.rdzv_backend not in RDZV_BACKENDS:
        raise errors.InvalidArgument(
            f"--rdzv-backend {a.rdzv_backend}: the rendezvous is snapshotter's own (it must "
            "outlive a thaw), so an external one is not used",
            f"drop it, or give one of {', '.join(RDZV_BACKENDS)}",
        )
    if a.node_rank is not None and a.node_rank < 0:
        raise errors.InvalidArgument(f"--node-rank {a.node_rank} is negative", "0..NNODES-1")
    notes = []
    for dest, why in NOTED.items():
        default = 0.1 if dest == "monitor_interval" else None
        if getattr(a, dest) not in (default, ""):
            notes.append(f"--{dest.replace('_', '-')} is taken without effect: {why}")
    return notes


def nproc_request(v: str) -> tuple[int, str]:
    """--nproc-per-node for a RunRequest: (a number, "") or (0, auto|cpu|gpu), which the
    coordinator counts on the job's agents, as torchrun counts on each node."""
    if v in NPROC_KINDS:
        return 0, v
    return nproc(v), ""


def nproc(v: str, cpus: int | None = None, gpus: int = 0) -> int:
    """--nproc-per-node as torchrun counts it on a machine with `cpus` CPUs (default: this
    one's) and `gpus` GPUs (launch/spec.py: nproc_for)."""
    if v in NPROC_KINDS:
        return nproc_for(v, cpus or os.cpu_count() or 1, gpus)
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise errors.InvalidArgument(
            f"--nproc-per-node {v!r} is not a positive whole number or auto|cpu|gpu", "fix it"
        )
    return n
