"""A built wheel runs away from the checkout: the sandbox init ships inside it, the control
plane is `snapshotter.coordinator` (no bare top-level `coordinator`), the contract's generated
code is current, and `snapshotter --version` answers."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from snapshotter import __version__

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_a_built_wheel_runs_without_the_checkout(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(ROOT)],
        check=True, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    (wheel,) = dist.glob("snapshotter-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "snapshotter/sandbox/_bin/snapinit" in names
    # The hook's native path is built on the node against the job's torch: its source travels.
    assert {"snapshotter/hook/_src/gate.cpp", "snapshotter/hook/_src/gate/backend.h"} <= set(names)
    assert not [n for n in names if "/_native/" in n]  # never a library built for another torch
    assert "snapshotter/coordinator/core.py" in names
    assert not [n for n in names if n.startswith(("coordinator/", "tests/", "bench/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
         str(wheel)],
        check=True, timeout=120,
    )  # fmt: skip
    # The installed copy wins over the checkout's editable one (PYTHONPATH comes first).
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = (
        "import snapshotter, snapshotter.coordinator.core, snapshotter.agent.node\n"
        "from snapshotter.sandbox.initbin import snapinit_path\n"
        "print(snapshotter.__file__); print(snapinit_path())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert all(p.startswith(str(site)) for p in out), out
    init = subprocess.run([out[1]], capture_output=True, text=True, timeout=10)
    assert init.returncode == 2 and "usage: snapinit" in init.stderr  # it runs here
    version = subprocess.run(
        [sys.executable, "-m", "snapshotter", "--version"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert version.stdout.strip() == f"snapshotter {__version__}"


def test_generated_code_matches_the_proto_files() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "gen_proto.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
