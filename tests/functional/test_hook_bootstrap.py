"""The bootstrap runs a script exactly as `python script.py` would, with or without the hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)

SCRIPT = """
import json, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__,
                  "hooked": "torch.distributed.distributed_c10d" in sys.modules
                  and getattr(sys.modules["torch.distributed.distributed_c10d"],
                              "_snapshotter_installed", False)}))
"""


def run(
    args: list[str],
    cwd: Path,
    extra_env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SNAPSHOTTER_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra_env or {})
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=50, pass_fds=pass_fds
    )


def test_script_sees_argv_and_path_as_without_bootstrap(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "job.py"
    script.write_text(SCRIPT)
    plain = run([sys.executable, "sub/job.py", "a", "--b"], tmp_path)
    booted = run(
        [sys.executable, "-m", "snapshotter.hook.bootstrap", "sub/job.py", "a", "--b"], tmp_path
    )
    assert booted.returncode == 0, booted.stderr
    assert json.loads(booted.stdout) == json.loads(plain.stdout)
    assert json.loads(booted.stdout)["hooked"] is False  # no control channel: nothing installed


def test_module_mode(tmp_path: Path) -> None:
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "__init__.py").write_text("")
    (tmp_path / "pkgx" / "job.py").write_text(SCRIPT)
    plain = run([sys.executable, "-m", "pkgx.job", "x"], tmp_path)
    booted = run(
        [sys.executable, "-m", "snapshotter.hook.bootstrap", "-m", "pkgx.job", "x"], tmp_path
    )
    assert booted.returncode == 0, booted.stderr
    assert json.loads(booted.stdout) == json.loads(plain.stdout)


def test_hook_installed_with_control_channel_and_exit_code_kept(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT + "\nraise SystemExit(3)\n")
    r, w = os.pipe()
    try:
        out = run(
            [sys.executable, "-m", "snapshotter.hook.bootstrap", str(script)],
            tmp_path,
            {"SNAPSHOTTER_CTL_IN": str(r), "SNAPSHOTTER_CTL_OUT": str(w)},
            (r, w),
        )
    finally:
        os.close(r)
        os.close(w)
    assert out.returncode == 3, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["hooked"] is True


def test_without_torch_runs_unhooked_and_says_so_once(tmp_path: Path) -> None:
    fake = tmp_path / "notorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    r, w = os.pipe()
    try:
        out = run(
            [sys.executable, "-m", "snapshotter.hook.bootstrap", str(script)],
            tmp_path,
            {
                "SNAPSHOTTER_CTL_IN": str(r),
                "SNAPSHOTTER_CTL_OUT": str(w),
                "PYTHONPATH": f"{tmp_path / 'notorch'}{os.pathsep}{REPO}",
            },
            (r, w),
        )
    finally:
        os.close(r)
        os.close(w)
    assert out.returncode == 0 and out.stdout == "ran\n"
    assert out.stderr.count("without the freeze hook") == 1
