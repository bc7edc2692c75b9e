"""What a job is: the command, its environment and its shape. Shared by CLI, coordinator and
agents, and recorded in every snapshot so a thaw can rebuild the job.

A snapshot keeps the job's environment only in part (`JobSpec.for_snapshot`): the variables
that start the job's interpreter (KEPT_ENV), and where its ranks write their root cause if
the job chose that itself (TORCHELASTIC_ERROR_FILE: the agent reads it when a thawed rank
fails), nothing else. That is enough for a thaw and a fork: the ranks' own environment comes
back with their memory (CRIU restores it), and the node's network settings are set anew by the
agent; the only process a thaw starts from the spec is the job's rendezvous server, which needs
the interpreter and its library paths. Every other variable (tokens, keys, credentials) is
omitted, and only its name is recorded.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from snapshotter import errors
from snapshotter.rpc import convert
from snapshotter.storage.format import DEFAULT_TENANT, validate_name
from snapshotter.v1 import common_pb2

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# What starts the job's interpreter on another node, and the job's own error file: never a
# secret.
KEPT_ENV = frozenset({
    "PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "VIRTUAL_ENV", "CONDA_PREFIX",
    "LD_LIBRARY_PATH", "LANG", "LC_ALL", "HOME", "TZ",
    "TORCHELASTIC_ERROR_FILE",  # a path, no secret (launch/rootcause.py)
})  # fmt: skip


def validate_job_id(job_id: str) -> str:
    if not _JOB_ID.match(job_id):
        raise errors.InvalidArgument(
            f"invalid job id {job_id!r}",
            "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return job_id


def new_job_id() -> str:
    return f"job-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    script: str
    script_args: list[str]
    module: bool
    python: str
    cwd: str
    env: dict[str, str] = field(repr=False)
    nnodes: int = 1
    nproc_per_node: int = 1
    # Whose job it is: its snapshots are sealed under this tenant's data keys (datakeys.py).
    tenant: str = DEFAULT_TENANT
    # The tenant withheld consent: the provider (a caller of no tenant) may not freeze it; the
    # tenant's own freezes and its policy snapshots go on.
    provider_opt_out: bool = False
    # Sealed at rest under the tenant's data keys: snapshots and application checkpoints.
    sealed: bool = False
    # What the coordinator does with the job by itself (kept in its snapshots, so a thawed
    # or recovered job keeps them). Empty messages: no policy snapshots, no recovery.
    policy: common_pb2.Policy = field(default_factory=common_pb2.Policy, compare=False)
    recovery: common_pb2.Recovery = field(default_factory=common_pb2.Recovery, compare=False)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["script_args"] = list(self.script_args)
        d["env"] = dict(self.env)
        d["policy"] = convert.plain(self.policy)
        d["recovery"] = convert.plain(self.recovery)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> JobSpec:
        return JobSpec(
            job_id=d["job_id"],
            script=d["script"],
            script_args=list(d["script_args"]),
            module=bool(d["module"]),
            python=d["python"],
            cwd=d["cwd"],
            env=dict(d["env"]),
            nnodes=int(d.get("nnodes", 1)),
            nproc_per_node=int(d.get("nproc_per_node", 1)),
            tenant=str(d.get("tenant") or DEFAULT_TENANT),
            provider_opt_out=bool(d.get("provider_opt_out", False)),
            sealed=bool(d.get("sealed", False)),
            # A snapshot of an older release has neither.
            policy=convert.parse(d.get("policy") or {}, common_pb2.Policy),
            recovery=convert.parse(d.get("recovery") or {}, common_pb2.Recovery),
        )

    def with_job_id(self, job_id: str) -> JobSpec:
        d = self.to_dict()
        d["job_id"] = job_id
        return JobSpec.from_dict(d)

    def with_policy(self, policy: common_pb2.Policy) -> JobSpec:
        d = self.to_dict()
        d["policy"] = convert.plain(policy)
        return JobSpec.from_dict(d)

    def for_snapshot(self) -> tuple[dict[str, Any], list[str]]:
        """The spec as a snapshot stores it (env: KEPT_ENV only), and the names omitted."""
        d = self.to_dict()
        d["env"] = {k: v for k, v in self.env.items() if k in KEPT_ENV}
        return d, sorted(k for k in self.env if k not in KEPT_ENV)

    def to_proto(self) -> common_pb2.JobSpec:
        return common_pb2.JobSpec(
            job_id=self.job_id,
            script=self.script,
            script_args=self.script_args,
            module=self.module,
            python=self.python,
            cwd=self.cwd,
            env=self.env,
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            tenant=self.tenant,
            provider_opt_out=self.provider_opt_out,
            sealed=self.sealed,
            policy=self.policy,
            recovery=self.recovery,
        )

    @staticmethod
    def from_proto(m: common_pb2.JobSpec) -> JobSpec:
        """Raises: InvalidArgument for a spec no agent could run."""
        spec = JobSpec(
            job_id=validate_job_id(m.job_id),
            script=m.script,
            script_args=list(m.script_args),
            module=m.module,
            python=m.python,
            cwd=m.cwd,
            env=dict(m.env),
            nnodes=m.nnodes or 1,
            nproc_per_node=m.nproc_per_node or 1,
            tenant=m.tenant or DEFAULT_TENANT,
            provider_opt_out=m.provider_opt_out,
            sealed=m.sealed,
            policy=m.policy,
            recovery=m.recovery,
        )
        spec.check()
        return spec

    def check(self) -> None:
        """Raises: InvalidArgument naming what is wrong with this spec."""
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise errors.InvalidArgument(
                f"--nnodes {self.nnodes} / --nproc-per-node {self.nproc_per_node} must be >= 1",
                "fix the flags",
            )
        if not self.script:
            raise errors.InvalidArgument("no script or module to run", "name one")
        try:
            validate_name(self.tenant, "tenant")
        except ValueError as e:
            raise errors.InvalidArgument(str(e), "fix --tenant") from e
        for what, path in (("interpreter", self.python), ("working directory", self.cwd)):
            if not path.startswith("/"):
                raise errors.InvalidArgument(
                    f"the job's {what} {path!r} is not an absolute path", "pass absolute paths"
                )


NPROC_KINDS = ("auto", "cpu", "gpu")


def nproc_for(kind: str, cpus: int, gpus: int, where: str = "this machine") -> int:
    """`--nproc-per-node auto|cpu|gpu` as torchrun counts it on a node with `cpus` CPUs and
    `gpus` GPUs: auto = the GPUs, else the CPUs; cpu = the CPUs; gpu = the GPUs.

    Raises:
        InvalidArgument: `gpu` on a node without GPUs, or an unknown kind.
    """
    cpus = max(cpus, 1)
    if kind == "auto":
        return gpus or cpus
    if kind == "cpu":
        return cpus
    if kind == "gpu":
        if gpus < 1:
            raise errors.InvalidArgument(f"--nproc-per-node gpu: {where} has no NVIDIA GPU",
                                         "give a number of ranks, or auto")  # fmt: skip
        return gpus
    raise errors.InvalidArgument(f"--nproc-per-node {kind!r} is not auto, cpu or gpu",
                                 "give a number of ranks, or auto|cpu|gpu")  # fmt: skip
