#!/usr/bin/env bash
# A/B of the take kernels that load the cells' words before their atomic (stable channels use the
# addresses loaded then) against the tree before (ab_old/, carried): bench/graph_rounds.py (1 MiB
# offload rounds alone) and the 1 MiB MLP-hidden row (save on device vs jaxvmm in one run), old and
# new alternating; then the graph-mode gpu suites with the new build (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
ab_rounds 2
for i in 1 2 3; do
  for v in old new; do
    $v bash -c 'timeout 60 python3 "$T/bench/train_step.py" --models mlp --targets mlp_hidden --mlp-shape 256,512,64 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 55' >> "$OUT/rows_$v.txt" 2>&1
    echo "=== row $v $i ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows_$v.txt" | tail -2 | cut -c1-110
  done
done
gpu_suites graph
exit 0
