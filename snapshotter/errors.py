"""Typed errors for everything a user can act on.

Every error carries a `cause` (what happened) and a `next_step` (what to do about it); the CLI
prints both and maps the type to an exit code. Raise with `raise ... from e` so the original
cause survives. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SHOWN = 8  # items an error message names before it says how many more there are


def few(items: Iterable[object], limit: int = SHOWN, sep: str = ", ") -> str:
    """The first `limit` of `items`, joined, then how many more there are: a message about
    thousands of nodes or ranks must stay readable (and small enough to send)."""
    shown, more = [], 0
    for i, item in enumerate(items):
        if i < limit:
            shown.append(str(item))
        else:
            more += 1
    return sep.join(shown) + (f"{sep}... and {more} more" if more else "")


class SnapshotterError(Exception):
    """Base of every error snapshotter reports to a user.

    A subclass with fields of its own (a log path, a job id) lists them in `fields`: they
    travel with the error (to_dict/from_dict, and across gRPC as a typed status detail) so
    the receiving side rebuilds the same error with everything it carried.
    """

    exit_code = 1
    code = "error"
    fields: tuple[str, ...] = ()

    def __init__(self, cause: str, next_step: str = "") -> None:
        super().__init__(cause)
        self.cause = cause
        self.next_step = next_step

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _BY_CODE[cls.code] = cls

    def __str__(self) -> str:
        if self.next_step:
            return f"{self.cause}\n  next step: {self.next_step}"
        return self.cause

    def field_values(self) -> dict[str, object]:
        return {f: getattr(self, f, None) for f in self.fields}

    def to_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "cause": self.cause,
            "next_step": self.next_step,
            **({"fields": self.field_values()} if self.fields else {}),
        }


_BY_CODE: dict[str, type[SnapshotterError]] = {"error": SnapshotterError}


class InvalidArgument(SnapshotterError):
    exit_code = 2
    code = "invalid_argument"


class JobNotFound(SnapshotterError):
    exit_code = 3
    code = "job_not_found"
    fields = ("job_id",)

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"no job with id {job_id!r}",
            "run `snapshotter jobs` to list known jobs",
        )
        self.job_id = job_id


class SnapshotNotFound(SnapshotterError):
    exit_code = 3
    code = "snapshot_not_found"
    fields = ("snapshot_id",)

    def __init__(self, snapshot_id: str, where: str = "") -> None:
        loc = f" in {where}" if where else ""
        super().__init__(
            f"no committed snapshot with id {snapshot_id!r}{loc}",
            "run `snapshotter list` to see committed snapshots",
        )
        self.snapshot_id = snapshot_id


class CheckpointNotFound(SnapshotterError):
    """No committed application checkpoint by that name (snapshotter.checkpoint)."""

    exit_code = 3
    code = "checkpoint_not_found"


class JobNotRunning(SnapshotterError):
    exit_code = 4
    code = "job_not_running"


class FreezeRefused(SnapshotterError):
    """The freeze did not start (job busy, finished, ...); the job is untouched."""

    exit_code = 5
    code = "freeze_refused"


class FreezeFailed(SnapshotterError):
    """The freeze started and failed; the job was put back as it was (or is reported)."""

    exit_code = 6
    code = "freeze_failed"


class QuiesceTimeout(FreezeFailed):
    code = "quiesce_timeout"


class ThawFailed(SnapshotterError):
    exit_code = 7
    code = "thaw_failed"


class MigrationFailed(SnapshotterError):
    """A migration did not complete; its message says where the ranks run now."""

    exit_code = 16
    code = "migration_failed"


class RerouteFailed(SnapshotterError):
    """A job's communicators could not be moved to another data link (or a link could not be
    routed around); its message says which plane the job uses now."""

    exit_code = 17
    code = "reroute_failed"


class SnapshotCorrupt(ThawFailed):
    code = "snapshot_corrupt"


class SnapshotUntrusted(ThawFailed):
    """Unsigned, signed by a key the coordinator does not trust, or altered since signed."""

    code = "snapshot_untrusted"


class KeyUnavailable(ThawFailed):
    """A sealed snapshot whose tenant data key this coordinator's key provider cannot give."""

    code = "key_unavailable"


class StorageUnavailable(SnapshotterError):
    exit_code = 8
    code = "storage_unavailable"


class CriuUnavailable(SnapshotterError):
    exit_code = 9
    code = "criu_unavailable"


class CriuFailed(SnapshotterError):
    """A CRIU dump or restore failed; carries the log path and its last error lines."""

    exit_code = 10
    code = "criu_failed"
    fields = ("action", "log_path", "tail", "first")

    def __init__(
        self,
        action: str,
        log_path: str,
        tail: Sequence[str],
        next_step: str = "",
        first: str = "",
    ) -> None:
        lines = "\n    ".join(tail) if tail else "(log empty)"
        why = f": {first}" if first else ""
        super().__init__(
            f"criu {action} failed{why}; log: {log_path}\n  last errors:\n    {lines}",
            next_step or f"read {log_path}; the job was left as it was before the {action}",
        )
        self.action = action
        self.log_path = log_path
        self.tail = list(tail)
        self.first = first


class GpuCheckpointError(SnapshotterError):
    exit_code = 11
    code = "gpu_checkpoint_failed"


class ServiceUnavailable(SnapshotterError):
    """The coordinator or an agent could not be reached."""

    exit_code = 12
    code = "service_unavailable"


class Internal(SnapshotterError):
    exit_code = 70
    code = "internal"


def from_dict(d: Mapping[str, Any]) -> SnapshotterError:
    """Rebuild an error sent as `to_dict()`: same class, message, next step and fields (an
    unknown code, from a newer peer, becomes the base class with the same text)."""
    cls = _BY_CODE.get(str(d.get("code", "")), SnapshotterError)
    err = SnapshotterError.__new__(cls)
    SnapshotterError.__init__(err, str(d.get("cause", "")), str(d.get("next_step", "")))
    values = d.get("fields") or {}
    for name in cls.fields:
        setattr(err, name, values.get(name) if isinstance(values, Mapping) else None)
    return err


class SandboxError(SnapshotterError):
    """A rank sandbox could not be built or started (no C compiler, spawn failed, ...)."""

    exit_code = 13
    code = "sandbox_failed"


class GpuDriverError(GpuCheckpointError):
    """A CUDA checkpoint driver call failed; carries the CUresult name (e.g. CUDA_ERROR_TIMEOUT)."""

    code = "gpu_driver_error"
    fields = ("op", "pid", "result")

    def __init__(self, op: str, pid: int, result: str, next_step: str = "") -> None:
        super().__init__(
            f"{op} of CUDA process {pid} failed: {result}",
            next_step or "see the agent log; the GPU stage put every process back as it was",
        )
        self.op = op
        self.pid = pid
        self.result = result


class GpuLockTimeout(GpuDriverError):
    """A CUDA process could not be locked in time (a kernel or CUDA call did not finish)."""

    code = "gpu_lock_timeout"


class GpuRemapRefused(GpuCheckpointError):
    """The snapshot's GPUs cannot be mapped onto this node's GPUs (fewer, or another type)."""

    code = "gpu_remap_refused"


class Fenced(ServiceUnavailable):
    """A coordinator acted after a newer one took over (its fencing token is stale)."""

    code = "fenced"




class Unauthenticated(SnapshotterError):
    """The caller presented no credential the service accepts (or a stale or forged one)."""

    exit_code = 14
    code = "unauthenticated"


class PermissionDenied(SnapshotterError):
    """The caller is known, but its role lacks the right the call needs."""

    exit_code = 14
    code = "permission_denied"
    fields = ("right", "identity")

    def __init__(self, cause: str, next_step: str, right: str = "", identity: str = "") -> None:
        super().__init__(cause, next_step)
        self.right = right
        self.identity = identity


class VersionMismatch(SnapshotterError):
    """The CLI, the coordinator or an agent run another release than their peer."""

    exit_code = 15
    code = "version_mismatch"
    fields = ("server_version", "client_version")

    def __init__(
        self, server: str, server_version: str, client: str, client_version: str
    ) -> None:
        super().__init__(
            f"version mismatch: {server} v{server_version}, {client} v{client_version}",
            "run the same snapshotter release on the CLI, the coordinator and every agent "
            "(`snapshotter --version` on each)",
        )
        self.server_version = server_version
        self.client_version = client_version
