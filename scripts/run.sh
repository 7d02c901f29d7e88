#!/usr/bin/env bash
# Set up, then run the main job: `gpufeed bench` on its built-in synthetic workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec gpufeed bench "$@"
