#!/usr/bin/env bash
# Device check for the GPU path (issue 4): freeze+thaw a single-process CUDA job and a
# 2-rank NCCL DDP job sharing GPU 0, and migrate one rank of a 2-rank gloo job on GPU 0 to a
# new sandbox while the other stays in memory (issue 12); each must finish bit-identical to
# an uninterrupted run. Also saves 1 GiB of CUDA state with dcp.async_save through
# snapshotter.checkpoint (issue 16) and loads it back, and pushes 1 GiB of CUDA weights from
# one agent's job to another's (snapshotter.weights). Each freeze case first reads every rank's
# telemetry (step time, collective latencies: what `snapshotter top` judges; NCCL on the
# hook's Python path).
# Prints one JSON line per case (GB/s of GPU state captured/restored, stall) and a summary.
#
# The device machine has torch + cuda-python but no package registry and no CRIU, so CRIU,
# pycriu's protobuf and the sandbox init travel in build/device/ (ignored by git: /build/):
#
#   # on the dev machine, once (about 15 MB):
#   bash bench/gpu_check.sh --pack
#   # then with the device tool:
#   run(command="bash bench/gpu_check.sh", carry=["build/device"], timeout_s=600)
#
# Rehearsal without a GPU (same orchestration, fake driver, CPU + gloo):
#   bash bench/gpu_check.sh --rehearse
#
# Budget: three cases x (reference + freeze-continue + thaw) and the migration (reference +
# migrate) of a ~0.5 GB-parameter job (8
# layers x 4096^2 fp32 plus grads and AdamW state, ~2 GB of GPU state per rank); 3-5 minutes.
# Rank logs and CRIU logs come back as $OUT/gpu-check-logs.tgz when $OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=build/device

if [[ "${1:-}" == "--pack" ]]; then
    mkdir -p "$DEV"
    tar -C / -czf "$DEV/criu.tgz" opt/snapshotter/criu
    SITE=$(.venv/bin/python -c 'import google.protobuf, os; print(os.path.dirname(os.path.dirname(os.path.dirname(google.protobuf.__file__))))')
    tar -C "$SITE" -czf "$DEV/protobuf.tgz" google/protobuf $(cd "$SITE" && ls -d protobuf-*.dist-info 2>/dev/null || true)
    .venv/bin/python -c 'from snapshotter.sandbox.initbin import snapinit_path as p; print(p())' >/dev/null
    cp snapshotter/sandbox/_bin/snapinit "$DEV/snapinit"
    du -sh "$DEV"
    exit 0
fi

if [[ "${1:-}" == "--rehearse" ]]; then
    .venv/bin/python bench/gpu_health_check.py --fake --seconds 1
    .venv/bin/python bench/gpu_ckpt_check.py --device cpu --mib 64
    .venv/bin/python bench/gpu_weights_check.py --device cpu --mib 64 --reps 3
    exec .venv/bin/python bench/gpu_check.py --driver fake --device cpu --steps 60 \
        --freeze-at 10 --width 256 --layers 2 --work "${TMPDIR:-/tmp}/snapshotter-gpu-rehearsal"
fi

# ---- on the device machine ----
PY=${PYTHON:-python3}
[[ -f "$DEV/criu.tgz" ]] || { echo "missing $DEV/criu.tgz: run bench/gpu_check.sh --pack here and carry build/device" >&2; exit 2; }
[[ -x /opt/snapshotter/criu/bin/criu ]] || tar -C / -xzf "$DEV/criu.tgz"
mkdir -p "$DEV/py"
[[ -d "$DEV/py/google/protobuf" ]] || tar -C "$DEV/py" -xzf "$DEV/protobuf.tgz"
export PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python   # no compiled upb for this Python
export PYTHONPATH="$PWD:/opt/snapshotter/criu/python:$PWD/$DEV/py${PYTHONPATH:+:$PYTHONPATH}"
export SNAPSHOTTER_SNAPINIT="$PWD/$DEV/snapinit"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv,noheader || true
/opt/snapshotter/criu/bin/criu --version | head -1
"$PY" -c 'import torch, cuda.bindings; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "cuda-python", cuda.bindings.__version__)'
uname -r
/opt/snapshotter/criu/bin/criu check 2>&1 | tail -5 || true   # diagnostic only: the run says more
# The hook's native gloo path, against the device's own torch, where it has a compiler and
# ninja; without them the ranks take the Python path and their logs say so.
timeout 180 "$PY" -m snapshotter.hook.native --build 2>&1 | tail -3 || true
timeout 150 "$PY" bench/gpu_preflight.py || true
timeout 30 "$PY" bench/gpu_health_check.py || true   # NVML: XID/ECC watcher on the real GPU
# Application checkpoints from CUDA memory: pinned staging slots, D2H stall, load bit-identical.
timeout 90 "$PY" bench/gpu_ckpt_check.py --device cuda --mib 1024 || true
# Weight push from and into CUDA tensors, between two agents (staged through pinned memory).
timeout 120 "$PY" bench/gpu_weights_check.py --device cuda --mib 1024 || true
rc=0
timeout 480 "$PY" bench/gpu_check.py --driver cuda --device cuda "$@" || rc=$?
if [[ -n "${OUT:-}" && -d /tmp/snapshotter-gpu-check ]]; then
    tar -C /tmp/snapshotter-gpu-check --exclude='*-images' -czf "$OUT/gpu-check-logs.tgz" . || true
fi
exit "$rc"
