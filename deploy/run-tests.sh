#!/usr/bin/env bash
# One command for a fresh machine: set everything up, then run lint, type checks, the check that
# the contract's generated code is current, and all tests (unit, functional, end to end: real
# CRIU, real SeaweedFS and network-namespace nodes started and stopped by the tests).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash deploy/install.sh --test-deps
VENV=${SNAPSHOTTER_VENV:-$ROOT/.venv}
echo "[tests] ruff"
# ruff does not follow the snapshotter/coordinator link; mypy checks it through the package.
"$VENV/bin/ruff" check snapshotter coordinator tests bench examples deploy/gen_proto.py
echo "[tests] mypy"
"$VENV/bin/mypy" snapshotter
echo "[tests] generated code of proto/ is current"
"$VENV/bin/python" deploy/gen_proto.py --check
echo "[tests] pytest"
exec "$VENV/bin/python" -m pytest -ra --durations=25 "$@"
