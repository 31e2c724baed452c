#!/usr/bin/env bash
# Session 34's first call: synchronize()/collect() and dying Tickets wait for computations whose outputs
# were all dropped (a per-device fence). Build, the dropped-computation lifetime tests on cuda:0, the gpu
# suites (graph + graph_xla, offload, remat, rest), then the MLP scan's block-input row with the
# driver-level timeline (save on device and jaxvmm in one run). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== built ($((SECONDS - T0)) s)"
JAXVMM_REQUIRE_GPU=1 gpu_tests lifetimes 150 tests/test_lifetimes.py
gpu_suites graph offload remat rest
timeout 120 python3 bench/train_step.py --models mlp --targets block_input --variants save,jaxvmm --steps 10 \
  --warmup 3 --timeline --timeout 115 > "$OUT/mlp_block_input.txt" 2>&1
echo "=== mlp block_input ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/mlp_block_input.txt" | cut -c1-600
exit 0
