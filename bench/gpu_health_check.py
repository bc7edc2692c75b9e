"""The GPU fault watcher (snapshotter/gpu/health.py) on this machine's real NVML, or on the
stand-in with --fake (what `gpu_check.sh --rehearse` runs): opens every GPU, registers for XID
and double-bit ECC events, polls the uncorrected ECC counts for a few seconds, prints what it
saw. With --fake it also injects an XID 79 and fails unless the watcher reports it.

Usage: python bench/gpu_health_check.py [--fake] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapshotter.gpu.health import GpuHealth  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    nvml: Any
    if a.fake:
        from snapshotter.testing.nvml_fake import FakeDevice, FakeNvml

        nvml = FakeNvml([FakeDevice("GPU-fake-0")])
    else:
        from cuda.bindings import nvml
    health = GpuHealth(nvml, poll_s=0.2).start()
    try:
        gpus = health.gpus()
        print(json.dumps({"gpus": gpus}), flush=True)
        if a.fake:
            nvml.xid(0, 79)
        time.sleep(a.seconds)
        faults = [f.__dict__ for f in health.faults(fatal_only=False)]
        print(json.dumps({"faults": faults}), flush=True)
    finally:
        health.stop()
    if a.fake and not any(f["code"] == 79 and f["fatal"] for f in faults):
        print("FAIL: the injected XID 79 was not reported", file=sys.stderr)
        return 1
    print(f"GPU health: {len(gpus)} GPU(s) watched, {len(faults)} fault(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
