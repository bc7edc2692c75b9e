"""What a job is: the command, its environment and its shape. Shared by CLI, coordinator and
agents, and recorded in every snapshot so a thaw can rebuild the job."""

from __future__ import annotations

import re
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from snapshotter import errors

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


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

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

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
        )

    def with_job_id(self, job_id: str) -> JobSpec:
        d = self.to_dict()
        d["job_id"] = job_id
        return JobSpec.from_dict(d)
