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
    # dev: ruff, mypy, pytest and every optional codec and format; test: Lightning, Accelerate
    # and HF datasets, which the suite runs gpufeed under (CPU builds suffice).
    bash scripts/setup.sh dev,test
    TORCH=$("$PY" -c "from importlib.metadata import version; print(version('torch').split('+')[0])")
    say "installing the docs tools (mkdocs-material, mkdocstrings) for the docs tests"
    pip_install "mkdocs-material>=9.5" "mkdocstrings[python]>=0.26" "torch==$TORCH"

    # ---- Packages other parts of the suite need: add them to EXTRA_PACKAGES below -----------
    # (each as a pip requirement; installed with torch pinned, so none can move it).
    EXTRA_PACKAGES=(
    )
    if [ ${#EXTRA_PACKAGES[@]} -gt 0 ]; then
        say "installing ${EXTRA_PACKAGES[*]}"
        pip_install "${EXTRA_PACKAGES[@]}" "torch==$TORCH"
    fi
    # ---- end of the packages other parts add -------------------------------------------------

    # The region-decode tests need a libjpeg-turbo >= 3.0 library; the `turbojpeg` wheel bundles
    # one (CPython 3.11 on x86_64 only; tests/conftest.py finds it, gpufeed never imports it).
    say "installing turbojpeg's bundled libjpeg-turbo 3 for the region-decode tests (best effort)"
    pip_install --no-deps "turbojpeg==0.0.2" 2>/dev/null \
        || say "no turbojpeg wheel for this platform: the region-decode tests will skip"
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
"$PY" -m ruff check src tests bench
say "mypy"
"$PY" -m mypy
say "pytest"
"$PY" -m pytest -q "$@"
