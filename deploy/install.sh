#!/usr/bin/env bash
# Sets up a fresh Debian 12 or 13 machine (as root) for snapshotter, idempotently:
#   system packages (compiler for csrc/, iproute2 for node namespaces),
#   CRIU >= 4.2 and pycriu (deploy/install-criu.sh),
#   a virtual environment with snapshotter (versions from constraints.txt) and, with
#   --with-job-deps, the demo/test job's own dependencies (the CPU build of torch==2.13.0: the
#   job's dependency, not snapshotter's) and the hook's native path built against it
#   (csrc/gate.cpp), the sandbox init built from csrc/, and the
#   `snapshotter` command on PATH (/usr/local/bin/snapshotter -> the venv's).
#   --gpu adds the GPU path's dependencies (cuda-python); --systemd installs the units of
#   deploy/systemd/ and an environment file template (/etc/snapshotter/snapshotter.env).
# Usage: deploy/install.sh [--with-job-deps] [--test-deps] [--gpu] [--systemd]
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${SNAPSHOTTER_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
JOB_DEPS=0
TEST_DEPS=0
GPU=0
SYSTEMD=0
for a in "$@"; do
  case "$a" in
    --with-job-deps) JOB_DEPS=1 ;;
    --test-deps) TEST_DEPS=1; JOB_DEPS=1 ;;
    --gpu) GPU=1 ;;
    --systemd) SYSTEMD=1 ;;
    *) echo "install.sh: unknown option $a" >&2; exit 2 ;;
  esac
done

say() { printf '[install] %s\n' "$*"; }

if [ "$(id -u)" -ne 0 ]; then
  echo "install.sh: run as root (CRIU needs it; packages are installed system-wide)" >&2
  exit 1
fi

need_pkgs=()
command -v cc >/dev/null 2>&1 || need_pkgs+=(gcc libc6-dev)
# The hook's native collective path (csrc/gate.cpp) is C++, built against the job's torch.
[ "$JOB_DEPS" = 1 ] && { command -v g++ >/dev/null 2>&1 || need_pkgs+=(g++); }
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need_pkgs+=(util-linux)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "installing system packages: ${need_pkgs[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$ROOT/constraints.txt")
want=()
[ "$TEST_DEPS" = 1 ] && want+=(test)
[ "$GPU" = 1 ] && want+=(gpu)
extras=""
[ ${#want[@]} -gt 0 ] && extras="[$(IFS=,; echo "${want[*]}")]"
say "installing snapshotter$extras into $VENV"
"${PIP[@]}" -e "$ROOT$extras"
if [ "$JOB_DEPS" = 1 ]; then
  # Pinned: a bare `torch` would pull a multi-GB CUDA build.
  say "installing the example job's dependencies (torch==2.13.0 CPU build, numpy)"
  trainers=()
  # The tests also run jobs on the trainers people use; installed with torch so that pip
  # never reaches for a CUDA build to satisfy them.
  [ "$TEST_DEPS" = 1 ] && trainers=(transformers accelerate)
  # ninja: torch's extension builder needs it for the hook's native path.
  "${PIP[@]}" "torch==2.13.0" numpy ninja "${trainers[@]}"
fi

bash "$ROOT/deploy/install-criu.sh" --python "$VENV/bin/python"

say "building the sandbox init (csrc/snapinit.c)"
"$VENV/bin/python" -c "from snapshotter.sandbox.initbin import snapinit_path; print(snapinit_path())"

if [ "$JOB_DEPS" = 1 ]; then
  # Against the torch just installed; a job whose torch differs runs the hook's Python path
  # (and its log says so). Run the same command with another torch to build for it.
  say "building the hook's native collective path (csrc/gate.cpp) for the job's torch"
  PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m snapshotter.hook.native --build
fi

# The command on PATH, for operators and for the systemd units (which name this path).
ln -sfn "$VENV/bin/snapshotter" /usr/local/bin/snapshotter
say "snapshotter $("$VENV/bin/snapshotter" --version | cut -d' ' -f2) at /usr/local/bin/snapshotter"
# The Slurm wrapper (deploy/slurm): sbatch runs a copy of the batch script, which finds it here.
install -m 0755 "$ROOT/deploy/slurm/snapshotter-slurm" /usr/local/bin/snapshotter-slurm

if [ "$SYSTEMD" = 1 ]; then
  install -m 0644 "$ROOT"/deploy/systemd/snapshotter-*.service /etc/systemd/system/
  install -d -m 0700 /etc/snapshotter
  [ -f /etc/snapshotter/snapshotter.env ] ||
    install -m 0600 "$ROOT/deploy/systemd/snapshotter.env.example" /etc/snapshotter/snapshotter.env
  command -v systemctl >/dev/null 2>&1 && systemctl daemon-reload || true
  say "systemd units installed; edit /etc/snapshotter/snapshotter.env, then enable them"
fi
say "done"
