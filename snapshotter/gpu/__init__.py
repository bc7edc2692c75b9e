"""GPU state around CRIU: NVIDIA's checkpoint driver API and the node's GPU stage (the driver
fake for tests lives in snapshotter/testing).

`auto_stage()` is what a node agent uses when nothing else is configured: the real driver when
this node has one, else None (one log line, never an error). `auto_health()` likewise: the
node's GPU fault watcher (health.py, NVML), or None.
"""

from __future__ import annotations

import logging
import os

from snapshotter.gpu.api import CheckpointDriver, GpuInfo, ProcessState
from snapshotter.gpu.health import GpuHealth
from snapshotter.gpu.stage import GpuStage, GpuStageSettings

log = logging.getLogger(__name__)

__all__ = ["CheckpointDriver", "GpuInfo", "GpuStage", "GpuStageSettings", "ProcessState",
           "auto_health", "auto_stage"]


def auto_stage() -> GpuStage | None:
    """The GPU stage of this node, or None without a usable NVIDIA driver.

    SNAPSHOTTER_GPU=off turns it off; SNAPSHOTTER_GPU_LOCK_TIMEOUT_S sets the lock timeout.
    """
    if os.environ.get("SNAPSHOTTER_GPU", "auto") == "off":
        log.info("GPU stage off: SNAPSHOTTER_GPU=off")
        return None
    from snapshotter.gpu.cuda import detect

    driver = detect()
    if driver is None:
        return None
    lock_s = float(os.environ.get("SNAPSHOTTER_GPU_LOCK_TIMEOUT_S", "30"))
    return GpuStage(driver, GpuStageSettings(lock_timeout_s=lock_s))


def auto_health() -> GpuHealth | None:
    """This node's GPU fault watcher (XID and ECC errors through NVML), or None without NVML.
    SNAPSHOTTER_GPU=off turns it off too."""
    if os.environ.get("SNAPSHOTTER_GPU", "auto") == "off":
        return None
    from snapshotter.gpu.health import detect

    return detect()
