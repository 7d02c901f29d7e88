#!/usr/bin/env bash
# Installs gpufeed, with the extras named in $1 (comma-separated, e.g. "cli" or "dev,test"),
# into the Python that runs the job: $PYTHON if set, else the `python3` on PATH (an activated
# virtual environment's). Used by run.sh (the main job) and test.sh (the suite).
#
# torch is installed first, pinned, and only when absent: a torch you already have (a CUDA build)
# is kept, and every later install pins the installed version, so that nothing can move it
# (another torch requirement would pull gigabytes of CUDA packages on a CPU-only machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
say() { echo "[setup $(date +%H:%M:%S)] $*"; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

"$PY" -c "import sys; assert sys.version_info >= (3, 10), sys.version" 2>/dev/null || {
    echo "[setup] $PY is not Python 3.10 or later: set PYTHON=/path/to/python3.10+" >&2; exit 1; }
say "installing into $("$PY" -c 'import sys; print(sys.prefix)')"
# The installed torch's version, read from its metadata (importing torch without numpy present
# prints a "Failed to initialize NumPy" warning, and takes seconds).
torch_version() {
    "$PY" -c "from importlib.metadata import version; print(version('torch').split('+')[0])" \
        2>/dev/null
}
TORCH=$(torch_version || true)
if [ -z "$TORCH" ]; then
    say "torch is absent: installing torch==2.13.0 with numpy (about 200 MB for the CPU wheel; a minute or two)"
    pip_install "torch==2.13.0" "numpy>=1.24"
    TORCH=$(torch_version)
else
    say "torch $TORCH is installed: kept"
fi
say "installing gpufeed${EXTRAS:+[$EXTRAS]} (editable, torch==$TORCH pinned)"
pip_install -e ".${EXTRAS:+[$EXTRAS]}" "torch==$TORCH"
say "done: gpufeed${EXTRAS:+[$EXTRAS]} on torch $TORCH"
