"""Where the sandbox init (`snapinit`, csrc/snapinit.c) comes from.

Order: $SNAPSHOTTER_SNAPINIT, then a binary next to this package (`_bin/snapinit`, gitignored),
built on first use from csrc/snapinit.c with `cc` under a file lock so that parallel callers
build it once. A binary older than its source is rebuilt. This module never runs the init.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from snapshotter.errors import SandboxError
from snapshotter.sandbox import children

ENV_VAR = "SNAPSHOTTER_SNAPINIT"
BIN_DIR = Path(__file__).resolve().parent / "_bin"
SOURCE = Path(__file__).resolve().parents[2] / "csrc" / "snapinit.c"
_CFLAGS = ["-O2", "-Wall", "-Wextra"]


def snapinit_path() -> Path:
    """Return the path of an executable snapinit, building it if needed.

    Raises:
        SandboxError: $SNAPSHOTTER_SNAPINIT names no executable, or no binary exists and it
            cannot be built (no source, no C compiler, compile error).
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override)
        if not os.access(path, os.X_OK):
            raise SandboxError(
                f"${ENV_VAR}={override} is not an executable file",
                f"unset {ENV_VAR} or point it at a built snapinit",
            )
        return path
    binary = BIN_DIR / "snapinit"
    if _fresh(binary):
        return binary
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    with open(BIN_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _fresh(binary):  # another process may have built it while we waited
            _build(binary)
    return binary


def _fresh(binary: Path) -> bool:
    if not os.access(binary, os.X_OK):
        return False
    try:
        return binary.stat().st_mtime >= SOURCE.stat().st_mtime
    except FileNotFoundError:  # installed without sources: the prebuilt one is all there is
        return True


def _build(binary: Path) -> None:
    if not SOURCE.is_file():
        raise SandboxError(
            f"no snapinit binary at {binary} and no source at {SOURCE} to build it from",
            f"build csrc/snapinit.c and set ${ENV_VAR} to the binary",
        )
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SandboxError(
            "no C compiler (cc) to build the sandbox init csrc/snapinit.c",
            f"install one (apt-get install gcc libc6-dev) or set ${ENV_VAR} to a built binary",
        )
    tmp = binary.with_name(f".snapinit.{os.getpid()}")
    errors = ""
    # Static first: the init then survives a restore on a node with another libc.
    for extra in (["-static"], []):
        proc = children.run(
            [cc, *_CFLAGS, *extra, "-o", str(tmp), str(SOURCE)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode == 0:
            os.replace(tmp, binary)
            return
        errors = proc.stderr.strip()
    tmp.unlink(missing_ok=True)
    raise SandboxError(
        f"building {SOURCE} with {cc} failed:\n{errors}",
        f"fix the compiler setup or set ${ENV_VAR} to a built binary",
    )
