#!/usr/bin/env bash
# A/B of the separate-node offload copy that issues its source loads before it reads the cell the take
# chose, against the tree before (ab_old/, carried): bench/graph_rounds.py (1 MiB offload rounds
# alone), old and new alternating; the 1 MiB MLP-hidden row three times with the new build; then the
# graph, offload and remat gpu suites (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
ab_rounds 2
: > "$OUT/rows.txt"
for i in 1 2 3; do ROW_TIMEOUT=50 mlp_row "1MiB#$i" 256,512,64 | cut -c1-130; done
gpu_suites graph offload remat
exit 0
