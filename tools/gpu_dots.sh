#!/usr/bin/env bash
# GPT with every no-batch-dim dot offloaded (bench/capacity.py trials at LAYERS, 16 by default, under a
# budget large enough that nothing is near it): save on device, full remat and jaxvmm, one fresh
# process each; then the MLP-hidden row with graph_spares SPARES (time against device memory: a spare
# keeps a layer on the device while PCIe is behind). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for p in ${POLICIES:-save remat jaxvmm-dots}; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -P bench/capacity.py --trial "$p" "${LAYERS:-16}" \
    --budget "${BUDGET:-120G}" > "$OUT/dots_$p.txt" 2>&1
  echo "=== dots $p ($((SECONDS - T0)) s)"; grep -E "CAPACITY_RESULT|Error" "$OUT/dots_$p.txt" | cut -c1-700
done
: > "$OUT/rows.txt"
for n in ${SPARES:-0 3 7}; do
  JAXVMM_DEBUG_GRAPH_SPARES=$n timeout 100 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --steps 10 --warmup 3 --timeline --timeout 90 >> "$OUT/rows.txt" 2>&1
  echo "=== mlp_hidden spares=$n ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-460
done
exit 0
