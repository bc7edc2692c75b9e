"""Device preflight: can a CUDA context be created where the ranks run?

Tries the same one-line CUDA program plainly, under `unshare` and inside the rank sandbox
(snapinit's PID namespace, with and without the private-TMPDIR mount namespace, with the
caller's environment and with a rank's minimal one), and prints one JSON line per variant:
which layer of the sandbox, if any, breaks CUDA on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from snapshotter.sandbox.spawn import become_subreaper, spawn  # noqa: E402

PROG = ("import torch; torch.cuda.init(); x = torch.ones(4, device='cuda'); "
        "print('cuda ok', float(x.sum()))")
DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def tail(b: bytes) -> str:
    return b.decode(errors="replace").strip().splitlines()[-1][-300:] if b.strip() else ""


def minimal_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}


def plain(name: str, prefix: list[str], env: dict[str, str]) -> None:
    p = subprocess.run([*prefix, sys.executable, "-c", PROG], env=env, capture_output=True,
                       timeout=120)
    print(json.dumps({"variant": name, "rc": p.returncode, "out": tail(p.stdout + p.stderr)}),
          flush=True)


def sandboxed(name: str, env: dict[str, str], private_tmp: Path | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        sb = spawn([sys.executable, "-c", PROG], env, str(ROOT), init_cwd=Path(d) / "init",
                   private_tmp=private_tmp)
        rc = sb.wait(120)
        out = b""
        for fd in (sb.io.stdout, sb.io.stderr):
            os.set_blocking(fd, False)
            try:
                while chunk := os.read(fd, 65536):
                    out += chunk
            except BlockingIOError:
                pass
        print(json.dumps({"variant": name, "rc": rc, "out": tail(out)}), flush=True)


def main() -> None:
    global PROG
    if DEVICE != "cuda":
        PROG = PROG.replace("torch.cuda.init(); ", "").replace("'cuda'", "'cpu'")
    become_subreaper()
    full = dict(os.environ)
    for name, fn in (
        ("plain/full-env", lambda: plain("plain/full-env", [], full)),
        ("plain/minimal-env", lambda: plain("plain/minimal-env", [], minimal_env())),
        ("unshare-pid", lambda: plain("unshare-pid", ["unshare", "--pid", "--fork"], full)),
        ("unshare-pid-mount-proc", lambda: plain(
            "unshare-pid-mount-proc", ["unshare", "--pid", "--fork", "--mount-proc"], full)),
        ("sandbox/full-env", lambda: sandboxed("sandbox/full-env", full, None)),
        ("sandbox/minimal-env", lambda: sandboxed("sandbox/minimal-env", minimal_env(), None)),
        ("sandbox/private-tmp", lambda: sandboxed(
            "sandbox/private-tmp", full, Path(tempfile.gettempdir()) / "snapshotter-pt")),
    ):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every variant reports
            print(json.dumps({"variant": name, "error": f"{type(e).__name__}: {e}"[-300:]}),
                  flush=True)


if __name__ == "__main__":
    main()
