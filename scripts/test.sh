#!/usr/bin/env bash
# The test command (README and CI): install, lint, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
$PY -m ruff check .
$PY -m ruff format --check .
$PY -m pytest -q test "$@"
