#!/usr/bin/env bash
# Device call: build, then the test ids given as arguments, one serial pytest run, short tracebacks.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
timeout ${T:-300} python3 -P -m pytest -v -rfs --tb=short -p no:cacheprovider "$@" > "$OUT/recheck.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/recheck.txt" | cut -c1-400 | tail -40
