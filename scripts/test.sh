#!/usr/bin/env bash
# The test command (CI runs it through .ci/run): install everything the suite needs, then lint
# (ruff), type check (mypy) and the whole test suite (pytest; GPU tests skip without CUDA).
# Arguments go to pytest. Honours PYTHON=/path/to/python: it installs into, and runs with, that
# Python. SKIP_SETUP=1 skips the installs (an environment set up before).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "[test $(date +%H:%M:%S)] $*"; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    # dev: ruff, mypy, pytest and every optional codec and format; image: the JPEG codecs (with
    # libjpeg-turbo 3 for region decoding where its wheel exists); test: Lightning, Accelerate,
    # transformers, HF datasets and Ray Data, which the suite runs gpufeed under (CPU builds
    # suffice); docs: mkdocs-material and mkdocstrings, for the strict docs build.
    bash scripts/setup.sh dev,image,test,docs
    TORCH=$("$PY" -c "from importlib.metadata import version; print(version('torch').split('+')[0])")
    # litdata (tests of shard readers) requires torchvision, which would replace torch: its
    # modules are installed first, then litdata last and without its dependencies, so that no
    # later install checks it (its tests skip when it cannot be imported).
    say "installing litdata without its torchvision requirement (its tests skip without it)"
    pip_install "lightning-utilities>=0.10" "filelock>=3" "boto3>=1" "obstore>=0.3" \
        "tifffile>=2023" "requests>=2" "urllib3>=1.26" "torch==$TORCH" \
        && pip_install --no-deps "litdata>=0.2" \
        || say "litdata could not be installed: its tests will skip"
fi
say "ruff"
"$PY" -m ruff check src tests bench conftest.py
say "mypy"
"$PY" -m mypy
say "pytest"
"$PY" -m pytest -q "$@"
