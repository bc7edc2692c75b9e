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
PYTEST=("$VENV/bin/python" -m pytest -ra --durations=25)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# Two pytest runs at once. The end-to-end tests mostly wait (jobs sleep between steps, deadlines
# run out), so two of them share this machine's two cores in about half the time of one after
# the other. The harness keeps them apart: network namespaces and subnets are claimed under a
# lock, every port is picked free, every daemon has its own home, each run its own basetemp.
# Run 1: the multi-node modules; run 2: everything else (new modules land here).
FIRST=(tests/e2e/test_multinode.py tests/e2e/test_multinode_faults.py)
IGNORE=()
for m in "${FIRST[@]}"; do IGNORE+=(--ignore "$m"); done
LOGS=$(mktemp -d /tmp/snapshotter-tests-logs.XXXXXX)
BASE=$(mktemp -d /tmp/snapshotter-tests-base.XXXXXX)
echo "[tests] run 1 (${FIRST[*]}) in the background, its log: $LOGS/run1.log"
"${PYTEST[@]}" --basetemp "$BASE/run1" "${FIRST[@]}" >"$LOGS/run1.log" 2>&1 &
first=$!
trap 'kill -INT "$first" 2>/dev/null; wait "$first" 2>/dev/null' INT TERM
echo "[tests] run 2 (every other test):"
set +e
"${PYTEST[@]}" --basetemp "$BASE/run2" tests "${IGNORE[@]}"
rc2=$?
wait "$first"
rc1=$?
set -e
trap - INT TERM
echo
echo "[tests] run 1 (${FIRST[*]}):"
cat "$LOGS/run1.log"
echo "[tests] run 1 exited $rc1, run 2 exited $rc2"
if [ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]; then
  rm -rf "$LOGS" "$BASE"
else
  echo "[tests] kept for a look: $BASE (each test's files), $LOGS"
fi
if [ "$rc1" -ne 0 ]; then exit "$rc1"; fi
exit "$rc2"
