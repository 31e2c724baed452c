#!/usr/bin/env bash
# After the review fix (go follows the guesses staged from offload cells; only sites of the waiting
# round's stream are read): the graph gpu suites, tools/step_counters.py on the 1 MiB row, the offload
# suite (JAXVMM_REQUIRE_GPU=1), then the 1 MiB row once. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph
timeout 40 python3 tools/step_counters.py --steps 3 > "$OUT/step_counters.txt" 2>&1
echo "=== step_counters ($((SECONDS - T0)) s)"; tail -2 "$OUT/step_counters.txt" | cut -c1-300
gpu_suites offload
: > "$OUT/rows.txt"
ROW_TIMEOUT=45 mlp_row 1MiB 256,512,64
exit 0
