#!/usr/bin/env bash
# The test command (README and CI): install, lint, then the test suite. `--all` adds the extended
# tier (long multi-process tests whose cases other tests cover; see test/conftest.py EXTENDED).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
$PY -m ruff check .
$PY -m ruff format --check .
if [ "${1:-}" = "--all" ]; then
    shift
    set -- --extended "$@"
fi
$PY -m pytest -q test "$@"
