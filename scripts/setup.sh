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
# litdata (tests of shard readers) depends on torchvision, which would replace torch: install it
# without its dependencies, then the few it imports (its tests skip when it cannot be imported).
"$PY" -m pip install -q --no-deps "litdata>=0.2"
"$PY" -m pip install -q "lightning-utilities>=0.10" "filelock>=3" "boto3>=1" "obstore>=0.3" \
    "tifffile>=2023" "requests>=2" "urllib3>=1.26" "torch==$TORCH" || true
# The region-decode tests need a libjpeg-turbo >= 3.0 library; the `turbojpeg` wheel bundles one
# (CPython 3.11 on x86_64 only; tests/conftest.py finds it, gpufeed never imports the package).
"$PY" -m pip install -q --no-deps "turbojpeg==0.0.2" || true
# JPEG region decoding (gpufeed.ImageFolder) needs libjpeg-turbo >= 3.0's libturbojpeg: best
# effort, only as root with apt, and only when the distribution's libturbojpeg0 is 3.x (Debian 12
# and 13 ship 2.1.5, which gpufeed does not use; without it JPEGs are decoded whole by simplejpeg).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    CANDIDATE=$(apt-cache policy libturbojpeg0 2>/dev/null | sed -n 's/ *Candidate: *//p')
    case "$CANDIDATE" in
        3.*|[0-9]:3.*) apt-get install -y -q libturbojpeg0 >/dev/null 2>&1 || true ;;
    esac
fi
