#!/usr/bin/env bash
# One command for a fresh machine: set everything up, then run the demo: a 2-rank CPU DDP job is
# launched, frozen mid-run (--stop), thawed, and finishes with the same parameters as an
# uninterrupted run (embedded default: local coordinator + agent, local directory storage).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
bash deploy/install.sh --with-job-deps
VENV=${SNAPSHOTTER_VENV:-$ROOT/.venv}
exec "$VENV/bin/python" examples/demo.py "$@"
