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
# The end-to-end tests write CRIU images, pages and store chunks (a few GiB at a time): a disk
# that fills halfway through fails dozens of unrelated tests with ENOSPC, so say so up front.
NEED_GIB=${SNAPSHOTTER_TESTS_NEED_GIB:-8}
TMP_DIR=${TMPDIR:-/tmp}
free_gib=$(( $(df --output=avail -k "$TMP_DIR" | tail -1) / 1024 / 1024 ))
if [ "$free_gib" -lt "$NEED_GIB" ]; then
  echo "[tests] error: $TMP_DIR has ${free_gib} GiB free and the tests need about ${NEED_GIB} GiB" >&2
  echo "  next step: free space there (earlier failed runs keep their files in" >&2
  echo "  $TMP_DIR/snapshotter-tests-base.* and $TMP_DIR/snapshotter-tests-logs.*), or set TMPDIR" >&2
  ls -d "$TMP_DIR"/snapshotter-tests-* 2>/dev/null | xargs -r du -sh 2>/dev/null | sed 's/^/    /' >&2
  exit 1
fi
echo "[tests] pytest"
PYTEST=("$VENV/bin/python" -m pytest -ra --durations=25)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# Two pytest runs at once. The end-to-end tests mostly wait (jobs sleep between steps, deadlines
# run out), so two of them share this machine's two cores in about half the time of one after
# the other. The harness keeps them apart: network namespaces and subnets are claimed under a
# lock, every port is picked free, every daemon has its own home, each run its own basetemp.
# Run 1: the multi-node modules, then the agent soak, the pipeline freezes and the real
# trainers; run 2: everything else (new modules land here). Balanced by what CI logged: with the
# trainers (about 6 minutes) in run 2, run 1 took 51 minutes and run 2 66, the last 15 alone.
FIRST=(tests/e2e/test_multinode.py tests/e2e/test_multinode_faults.py
       tests/e2e/test_agent_soak.py tests/e2e/test_pipeline.py tests/e2e/test_trainers.py)
IGNORE=()
for m in "${FIRST[@]}"; do IGNORE+=(--ignore "$m"); done
LOGS=$(mktemp -d "$TMP_DIR/snapshotter-tests-logs.XXXXXX")
BASE=$(mktemp -d "$TMP_DIR/snapshotter-tests-base.XXXXXX")
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
  # Logs and small files stay for a look; images and chunks would only fill the disk.
  find "$BASE" -xdev -type f -size +1M ! -name '*.log' ! -name '*.json' -delete 2>/dev/null || true
  echo "[tests] kept for a look: $BASE (each test's files, $(du -sh "$BASE" | cut -f1)), $LOGS"
fi
if [ "$rc1" -ne 0 ]; then exit "$rc1"; fi
exit "$rc2"
