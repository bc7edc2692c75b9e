"""Start a rank with the hook installed, then run the training script unchanged as __main__.

    python -m snapshotter.hook.bootstrap script.py [args...]
    python -m snapshotter.hook.bootstrap -m package.module [args...]

`sys.argv` and `sys.path[0]` end up exactly as `python script.py args` (or `python -m module
args`) would have set them. Without SNAPSHOTTER_CTL_IN/OUT nothing is installed. Without torch
the script runs unhooked and one line on stderr says so.

Imports only stdlib at module level (the agent may start ranks whose Python lacks anything else);
never changes the script's exit status.
"""

from __future__ import annotations

import os
import runpy
import sys

from snapshotter.hook.control import Hook, from_env, warn

USAGE = "usage: python -m snapshotter.hook.bootstrap (script.py | -m module) [args...]"


def install() -> Hook | None:
    """Install the hook as the environment asks; never raises."""
    hook = from_env()
    if hook is None:
        return None
    # NCCL >= 2.24 starts a process-wide RAS service on first communicator init whose listening
    # sockets (127.0.0.1:28028 and one on the bootstrap interface) outlive every communicator:
    # a rank holding them cannot be suspended (seen on the H200 machine). The job's own setting
    # wins, and a freeze then names those sockets.
    os.environ.setdefault("NCCL_RAS_ENABLE", "0")
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        warn(f"torch is not importable ({e}); running the script without the freeze hook")
        hook.disabled = f"torch is not importable: {e}"
        hook.start()
        return hook
    try:
        hook.install_torch()
    except Exception as e:
        # Run the job anyway; every freeze request will be answered with this reason.
        warn(f"could not install the freeze hook ({type(e).__name__}: {e}); running without it")
        hook.disabled = f"install failed: {type(e).__name__}: {e}"
    hook.start()
    return hook


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr)
        return 2
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        module, rest = args[1], args[2:]
        install()
        # `python -m` puts the cwd first on sys.path; so did `python -m snapshotter...`.
        sys.argv = [module, *rest]  # runpy replaces argv[0] with the module's path
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    script, rest = args[0], args[1:]
    install()
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
