#!/usr/bin/env bash
# Spare cells on one-cell call sites (large activations), H200, <= ~5 minutes: the graph-mode gpu tests
# with one cell and 2 spares per call site, then the MLP-scan MLP-hidden row (256 MiB per offload,
# 6 GiB per step) with 0 and 4 spares, save on device in the same run as each. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
JAXVMM_GRAPH_CELLS=1 JAXVMM_GRAPH_SPARES=2 gpu_tests graph_k1_spares2 80 tests/test_graph.py
row() {  # row SPARES
  JAXVMM_GRAPH_SPARES=$1 timeout 100 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --steps 10 --warmup 2 --timeout 95 >> "$OUT/rows.txt" 2>&1
  echo "=== row mlp hidden spares=$1 ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-420
}
: > "$OUT/rows.txt"
row 4
row 0
