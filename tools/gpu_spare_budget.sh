#!/usr/bin/env bash
# graph_spare_budget on the 4 MiB row (two cells; every offload call site gets 64 spares, the budget
# caps what they map at once): mlp_row with JAXVMM_GRAPH_SPARE_BUDGET=BUDGET (128M: 32 activations).
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
ROW_TIMEOUT=45 mlp_row "4MiB budget=${BUDGET:-128M}" 1024,512,64 JAXVMM_GRAPH_SPARE_BUDGET="${BUDGET:-128M}"
grep -E "spares mapped" "$OUT/rows.txt" | tail -1 | grep -oE "[0-9]+ lends[^|]*" | head -1
exit 0
