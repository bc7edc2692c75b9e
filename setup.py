"""Builds the sandbox init (csrc/snapinit.c) into the package, so an installed wheel runs
without a checkout: `snapshotter/sandbox/_bin/snapinit`, found by snapshotter/sandbox/initbin.py.
Everything else about the package is in pyproject.toml. An editable install (a checkout)
builds the init on first use instead, from csrc/.
"""

import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

SOURCE = Path("csrc") / "snapinit.c"


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        # The hook's native path is built on the node against the job's torch
        # (`python -m snapshotter.hook.native --build`): its source travels with the package.
        src = Path(self.build_lib) / "snapshotter" / "hook" / "_src"
        src.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path("csrc") / "gate.cpp", src / "gate.cpp")
        shutil.copytree(Path("csrc") / "gate", src / "gate", dirs_exist_ok=True)
        out = Path(self.build_lib) / "snapshotter" / "sandbox" / "_bin" / "snapinit"
        out.parent.mkdir(parents=True, exist_ok=True)
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise SystemExit("building the sandbox init needs a C compiler (apt-get install gcc)")
        # Static first: the init then survives a restore on a node with another libc.
        for extra in (["-static"], []):
            cmd = [cc, "-O2", "-Wall", "-Wextra", *extra, "-o", str(out), str(SOURCE)]
            if subprocess.run(cmd, check=False).returncode == 0:
                return
        raise SystemExit(f"building {SOURCE} failed")


class PlatformDistribution(Distribution):
    """The wheel carries an executable: it is for one platform, not pure Python."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_py": BuildPy}, distclass=PlatformDistribution)
