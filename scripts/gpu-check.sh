#!/usr/bin/env bash
# The checks that need a real GPU, in one run of about seven minutes: every test marked
# `cuda`, the GPU benchmark (bench/results/gpu.md), the GPU JPEG decode's library, tests
# and benchmark (bench/results/gpu_decode.md), the doctor, and the device, memory and tools
# tests with CUDA present. Logs and results go to $OUT (default /tmp/gpu-check).
# Runs from a checkout with `python3` holding a CUDA build of torch; gpufeed from ./src.
# Without CUDA it says so and exits 0 (GPU_CHECK_FORCE=1 runs the steps anyway: each one
# skips its GPU parts). STEPS="..." runs only the steps named (see `want` below).
# The GPU decode needs nvImageCodec and nvJPEG: when they are not installed, the wheels found in
# $GPUFEED_WHEELS (default ./wheels; the machine may have no network) are installed from there:
#   pip download --no-deps -d wheels nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12   (or -cu13)
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEPS=${STEPS:-"decode-lib cuda-tests decode-tests gpu-bench decode-bench doctor rest"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
{
    date -u
    nvidia-smi -L 2>&1
    $PY -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
        && [ -z "${GPU_CHECK_FORCE:-}" ]; then
    echo "no CUDA device: the GPU checks are skipped" | tee -a "$OUT/env.txt"
    exit 0
fi
pytest=($PY -m pytest -p no:cacheprovider -q -ra -o faulthandler_timeout=120)
if want decode-lib; then
    echo "== GPU decode library (nvImageCodec)"
    {
        if ! $PY -c "import nvidia.nvimgcodec" 2>/dev/null; then
            major=$($PY -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
            wheels=${GPUFEED_WHEELS:-wheels}
            if [ -d "$wheels" ]; then
                timeout 120 $PY -m pip install -q --no-index --find-links "$wheels" \
                    "nvidia-nvimgcodec-cu$major[nvjpeg]" || echo "install from $wheels failed"
            else
                echo "nvImageCodec is not installed and $wheels holds no wheel: the GPU decode" \
                     "tests and benchmark will skip"
            fi
        fi
        $PY -c "from nvidia import nvimgcodec as n; print('nvImageCodec', getattr(n, '__version__', '?'),
'DecodeSource' if hasattr(n, 'DecodeSource') else 'no DecodeSource')" 2>/dev/null \
            || echo "nvImageCodec: not importable"
    } 2>&1 | tee "$OUT/decode-lib.txt"
fi
if want cuda-tests; then
    echo "== tests marked cuda (the GPU decode's apart, below)"
    timeout 240 "${pytest[@]}" -m cuda tests --ignore=tests/device/test_decode_cuda.py \
        > "$OUT/cuda-tests.log" 2>&1
    echo "exit $?" >> "$OUT/cuda-tests.log"; tail -n 25 "$OUT/cuda-tests.log"
fi
if want decode-tests; then
    echo "== GPU decode tests (pixels against the CPU path: the measured differences printed)"
    timeout 120 "${pytest[@]}" -s -m cuda tests/device/test_decode_cuda.py \
        > "$OUT/decode-tests.log" 2>&1
    echo "exit $?" >> "$OUT/decode-tests.log"
    grep -E "GPU vs CPU path" "$OUT/decode-tests.log"; tail -n 15 "$OUT/decode-tests.log"
fi
if want gpu-bench; then
    echo "== GPU benchmark"
    timeout 200 $PY -m bench gpu --out "$OUT" 2>&1 | tail -n 30
fi
if want decode-bench; then
    echo "== GPU decode benchmark"
    timeout 100 $PY -m bench.gpu_decode --images 512 --rounds 3 --out "$OUT" \
        --cache "$OUT/cache" > "$OUT/decode-bench.log" 2>&1
    echo "exit $?" >> "$OUT/decode-bench.log"; tail -n 25 "$OUT/decode-bench.log"
fi
if want doctor; then
    echo "== doctor"
    timeout 60 $PY -m gpufeed doctor --no-progress --json "$OUT/doctor.json" > "$OUT/doctor.txt" 2>&1
    echo "exit $?" >> "$OUT/doctor.txt"; cat "$OUT/doctor.txt"
fi
if want rest; then
    echo "== device, memory and tools tests with CUDA present"
    timeout 260 "${pytest[@]}" -m "not cuda" tests/device tests/memory tests/tools > "$OUT/rest.log" 2>&1
    echo "exit $?" >> "$OUT/rest.log"; tail -n 25 "$OUT/rest.log"
fi
