#!/usr/bin/env bash
# Call sites of exactly 32 MiB arrays made large (one cell, held, trading pages) against the tree
# before (ab_old/, carried): the GPT block's block-input row (batch 2 x 2048 x 4096 bf16: 32 MiB a
# layer, L=16), save on device and jaxvmm in one run with the driver-level timeline, old then new,
# twice; then the graph-mode gpu suites with the new build (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
echo "=== built ($((SECONDS - T0)) s)"
for i in 1 2; do
  for v in old new; do
    $v bash -c 'timeout 90 python3 "$T/bench/train_step.py" --models gpt --targets block_input --variants save,jaxvmm --steps 8 --timeline --timeout 85' >> "$OUT/rows_$v.txt" 2>&1
    echo "=== row $v $i ($((SECONDS - T0)) s)"; grep -E "^\| gpt" "$OUT/rows_$v.txt" | tail -1 | cut -c1-400
  done
done
gpu_suites graph
exit 0
