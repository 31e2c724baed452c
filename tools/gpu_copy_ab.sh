#!/usr/bin/env bash
# A/B of the separate-node offload copy that issues its source loads before it reads the cell the take
# chose, against the tree before (ab_old/, carried): bench/graph_rounds.py (1 MiB offload rounds
# alone), old and new alternating; the 1 MiB MLP-hidden row three times with the new build; then the
# graph, offload and remat gpu suites (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
for i in 1 2; do
  for v in old new; do
    $v bash -c 'timeout 60 python3 "$T/bench/graph_rounds.py" --size 1M --reps 40' > "$OUT/rounds_$v$i.txt" 2>&1
    echo "=== rounds $v $i ($((SECONDS - T0)) s)"; grep -E "^\|" "$OUT/rounds_$v$i.txt" | tail -2
  done
done
: > "$OUT/rows.txt"
for i in 1 2 3; do ROW_TIMEOUT=50 mlp_row "1MiB#$i" 256,512,64 | cut -c1-130; done
gpu_suites graph offload remat
exit 0
