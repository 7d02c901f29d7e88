#!/usr/bin/env bash
# Installs gpufeed and what it needs into the current Python.
# torch is installed first, pinned, and only when absent: any other torch
# requirement would pull gigabytes of CUDA packages on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
# dev: lint/type/test tools; test: Lightning, Accelerate and HF datasets, which the suite
# runs gpufeed under. The installed torch is pinned so that none of them can move it.
TORCH=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
"$PY" -m pip install -q -e ".[dev,test]" "torch==$TORCH"
