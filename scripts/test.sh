#!/usr/bin/env bash
# Set up, then run the whole suite: lint, type check, tests (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
"$PY" -m ruff check src tests bench
"$PY" -m mypy
"$PY" -m pytest -q "$@"
