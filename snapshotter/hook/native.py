"""The hook's native collective path (csrc/gate.cpp): how it is built, found and driven.

Between freezes every op of a gloo group runs in C++ only: a `CountingBackend` counts it on the
native `Gate` and forwards it to the real gloo backend. The Python `QuiesceBarrier` stays the
reference state machine and the fallback where the extension cannot be loaded: a rank whose
torch is not the one the extension was built against, or SNAPSHOTTER_NATIVE_HOOK=0.

The extension is built once per torch version (deploy/install.sh runs `python -m
snapshotter.hook.native --build`), never in a rank: compiling takes a minute.

Imports only stdlib at module level; torch is imported by `build` alone (a rank has it already).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from snapshotter.hook.barrier import BarrierError, ParkPoint, Pending, State

ENV_VAR = "SNAPSHOTTER_NATIVE_HOOK"
MODULE = "snapshotter_gate"
_HERE = Path(__file__).resolve().parent
# A checkout's csrc/, or the copy a wheel carries (setup.py puts it there).
_SOURCES = (_HERE.parents[1] / "csrc" / "gate.cpp", _HERE / "_src" / "gate.cpp")
SOURCE = next((p for p in _SOURCES if p.exists()), _SOURCES[0])
HEADERS = SOURCE.parent / "gate"  # gate/work.h, gate/gate.h, gate/backend.h
BUILD_ROOT = _HERE / "_native"


def build_dir(torch_version: str) -> Path:
    """Where the extension for this torch version lives (one directory per version)."""
    return BUILD_ROOT / ("torch-" + re.sub(r"[^A-Za-z0-9._+-]", "_", torch_version))


def _library(torch_version: str) -> Path | None:
    for p in sorted(build_dir(torch_version).glob(MODULE + "*.so")):
        return p
    return None


def _stale(lib: Path) -> bool:
    sources = [SOURCE, *HEADERS.glob("*.h")]
    try:
        newest = max(p.stat().st_mtime for p in sources)
    except FileNotFoundError:  # installed without sources: the built one is all there is
        return False
    return lib.stat().st_mtime < newest


def load() -> ModuleType | None:
    """The extension for the torch this process imported, or None (not built, or disabled)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    lib = _library(str(torch.__version__))
    if lib is None or _stale(lib):
        return None
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(lib))
    spec = importlib.util.spec_from_file_location(MODULE, lib, loader=loader)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE] = module
    return module


def build(verbose: bool = False) -> Path:
    """Compile csrc/gate.cpp against the installed torch; return the library's path."""
    import torch
    from torch.utils import cpp_extension

    out = build_dir(str(torch.__version__))
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=MODULE,
        sources=[str(SOURCE)],
        extra_include_paths=[str(SOURCE.parent)],
        build_directory=str(out),
        extra_cflags=["-O2"],
        verbose=verbose,
        is_python_module=True,
    )
    lib = _library(str(torch.__version__))
    if lib is None:
        raise RuntimeError(f"the build left no {MODULE}*.so in {out}")
    return lib


class NativeBarrier:
    """`QuiesceBarrier`'s interface over the native gate (same states, same errors)."""

    def __init__(self, ext: ModuleType, on_parked: Callable[[str, ParkPoint | None], None]):
        def parked(freeze: str, at: tuple[str, int] | None) -> None:
            on_parked(freeze, None if at is None else ParkPoint(at[0], at[1]))

        self.ext = ext
        self.gate: Any = ext.Gate(parked)

    def _call(self, name: str, *args: Any) -> Any:
        try:
            return getattr(self.gate, name)(*args)
        except self.ext.GateError as e:
            raise BarrierError(str(e)) from None

    def add_group(self, key: str) -> None:
        self.gate.add_group(key)

    def remove_group(self, key: str) -> None:
        self.gate.remove_group(key)

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        self.gate.setup_begin()
        try:
            yield
        finally:
            self.gate.setup_end()

    def enter(self, key: str) -> int:
        return int(self._call("enter", key))

    def track(self, op: Pending) -> None:
        self.gate.track(op)

    def in_flight(self) -> int:
        return int(self.gate.in_flight())

    def oldest_in_flight_s(self) -> float:
        return float(self.gate.oldest_in_flight_s())

    @property
    def state(self) -> State:
        return State(self.gate.state())

    def counts(self) -> dict[str, int]:
        return dict(self.gate.counts())

    def latencies(self) -> dict[str, tuple[int, list[tuple[int, float]]]]:
        """Native ops' latencies per key: (completed, the latest (seq, seconds))."""
        return {k: (int(n), [(int(q), float(v)) for q, v in e])
                for k, (n, e) in self.gate.latencies().items()}  # fmt: skip

    def prepare(self, freeze_id: str) -> dict[str, int]:
        return dict(self._call("prepare", freeze_id))

    def arm(self, freeze_id: str, targets: Mapping[str, int]) -> None:
        self._call("arm", freeze_id, {k: int(v) for k, v in targets.items()})

    def abort(self, freeze_id: str) -> None:
        self._call("abort", freeze_id)

    def expire_hold(self, freeze_id: str) -> bool:
        return bool(self._call("expire_hold", freeze_id))

    def suspend(self, freeze_id: str) -> None:
        self._call("suspend", freeze_id)

    def release(self, freeze_id: str) -> None:
        self._call("release", freeze_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="build the hook's native collective path")
    ap.add_argument("--build", action="store_true", help="compile csrc/gate.cpp")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    if not a.build:
        ap.print_help()
        return 2
    print(build(verbose=a.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
