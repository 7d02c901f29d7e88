#!/usr/bin/env bash
# The main job: install what `gpufeed bench` needs (torch if absent, gpufeed with its `cli`
# extra: progress bars and tables), then run it on its built-in synthetic workload (no files,
# no GPU; about 2 minutes on 2 cores). Arguments go to `gpufeed bench` (e.g. --quick, --json FILE).
# Honours PYTHON=/path/to/python: it installs into, and runs with, that Python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh cli
echo "[run $(date +%H:%M:%S)] $PY -m gpufeed bench $* (about 2 min on 2 idle cores; the tables print at the end)"
exec "$PY" -m gpufeed bench "$@"
