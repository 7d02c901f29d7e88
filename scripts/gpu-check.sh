#!/usr/bin/env bash
# The checks that need a real GPU, in one run of about six minutes: every test marked
# `cuda`, the GPU benchmark (bench/results/gpu.md), the doctor, and the device, memory
# and tools tests with CUDA present. Logs and results go to $OUT (default /tmp/gpu-check).
# Runs from a checkout with `python3` holding a CUDA build of torch; gpufeed from ./src.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
    date -u
    nvidia-smi -L 2>&1
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
pytest=($PY -m pytest -p no:cacheprovider -q -ra -o faulthandler_timeout=120)
echo "== tests marked cuda"
timeout 240 "${pytest[@]}" -m cuda tests > "$OUT/cuda-tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda-tests.log"; tail -n 25 "$OUT/cuda-tests.log"
echo "== GPU benchmark"
timeout 200 $PY -m bench gpu --out "$OUT" 2>&1 | tail -n 30
echo "== doctor"
timeout 60 $PY -m gpufeed doctor --no-progress --json "$OUT/doctor.json" > "$OUT/doctor.txt" 2>&1
echo "exit $?" >> "$OUT/doctor.txt"; cat "$OUT/doctor.txt"
echo "== device, memory and tools tests with CUDA present"
timeout 260 "${pytest[@]}" -m "not cuda" tests/device tests/memory tests/tools > "$OUT/rest.log" 2>&1
echo "exit $?" >> "$OUT/rest.log"; tail -n 25 "$OUT/rest.log"
