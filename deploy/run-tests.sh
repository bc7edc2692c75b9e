#!/usr/bin/env bash
# One command for a fresh machine: set everything up, then run lint, type checks and all tests
# (unit, functional, end to end: real CRIU, real SeaweedFS started by the tests).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash deploy/install.sh --test-deps
VENV=${SNAPSHOTTER_VENV:-$ROOT/.venv}
echo "[tests] ruff"
"$VENV/bin/ruff" check snapshotter coordinator tests bench examples
echo "[tests] mypy"
"$VENV/bin/mypy" snapshotter coordinator
echo "[tests] pytest"
exec "$VENV/bin/python" -m pytest -ra "$@"
