#!/usr/bin/env bash
# Early launch of a round's copy and publish kernels (programmatic dependent launch, JAXVMM_GRAPH_PDL)
# on the H200, in one build: bench/graph_rounds.py (fused / three nodes / three nodes launched early),
# then the 1 MiB MLP-hidden row (save on device vs jaxvmm in one run) with JAXVMM_GRAPH_PDL=0 and =1
# alternating ROWS (3) times, then the graph-mode and offload gpu suites (JAXVMM_REQUIRE_GPU=1, early
# launch on by default). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for i in 1 2; do
  timeout 60 python3 bench/graph_rounds.py --size 1M --reps 40 > "$OUT/rounds_$i.txt" 2>&1
  echo "=== rounds $i ($((SECONDS - T0)) s)"; grep -E "^\||Error|error" "$OUT/rounds_$i.txt" | tail -4
done
: > "$OUT/rows.txt"
for i in $(seq "${ROWS:-3}"); do
  for pdl in 0 1; do ROW_TIMEOUT=50 mlp_row "1MiB#$i pdl=$pdl" 256,512,64 JAXVMM_GRAPH_PDL=$pdl; done
done
gpu_suites graph offload
exit 0
