"""Which interpreters and working directories an agent starts jobs with.

A Launch names the interpreter, the working directory and the environment of processes the
agent starts as root, so only what the node's operator allowed runs:

  --allow-python PATH   an interpreter, or a directory whose interpreters are allowed
                        (default: the agent's own, sys.executable)
  --allow-cwd DIR       a directory a job may run in, with everything below it (default none)

The embedded daemon, reachable only by root through its unix socket, allows anything: its
caller could start the same processes itself. Pure checks, no I/O beyond resolving paths.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from snapshotter import errors
from snapshotter.launch.spec import JobSpec


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass(frozen=True)
class ExecPolicy:
    pythons: tuple[str, ...] = ()
    cwds: tuple[str, ...] = ()
    anything: bool = False

    @staticmethod
    def default(pythons: Sequence[str] = (), cwds: Sequence[str] = ()) -> ExecPolicy:
        # Interpreters are compared by the path they are started as (a venv's python is a
        # symlink whose own path selects the venv); directories by their real location.
        return ExecPolicy(
            pythons=tuple(os.path.normpath(p) for p in (*pythons, sys.executable)),
            cwds=tuple(os.path.realpath(c) for c in cwds),
        )

    def check(self, spec: JobSpec, node: str) -> None:
        """Raises: PermissionDenied naming the setting that would allow the job."""
        if self.anything:
            return
        python = os.path.normpath(spec.python)
        if not _under(python, self.pythons):
            raise errors.PermissionDenied(
                f"the agent on node {node} runs jobs only with {', '.join(self.pythons)}; "
                f"{spec.python} is not allowed",
                f"use an allowed interpreter, or allow it on that node's agent "
                f"(--allow-python {spec.python})",
                right="allow-python",
            )
        cwd = os.path.realpath(spec.cwd)
        if not _under(cwd, self.cwds):
            allowed = ", ".join(self.cwds) or "no directory yet"
            raise errors.PermissionDenied(
                f"the agent on node {node} runs jobs only in {allowed}; {spec.cwd} is not "
                "under any of them",
                f"run the job from an allowed directory, or allow it on that node's agent "
                f"(--allow-cwd {spec.cwd})",
                right="allow-cwd",
            )
