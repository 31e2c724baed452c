#!/usr/bin/env bash
# One device call (nvidia-h200, ~6 min): rounds as separate nodes (take, copy, publish: no grid-wide
# last-block fences) against the fused round, in one build: bench/graph_rounds.py (rounds alone, 1 and
# 4 MiB), the 1 MiB row twice each way and the 4 MiB row with spares each way (JAXVMM_GRAPH_FUSED=1/0),
# then the graph-mode gpu tests (both ways: the round_kernels fixture). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
: > "$OUT/rows.txt"
for size in 1M 4M; do
  timeout 60 python3 bench/graph_rounds.py --size $size --reps 40 > "$OUT/rounds_$size.txt" 2>&1
  echo "=== rounds $size ($((SECONDS - T0)) s)"; grep -E "^\|" "$OUT/rounds_$size.txt" | tail -2
done
for i in 1 2; do
  mlp_row fused 256,512,64 JAXVMM_GRAPH_FUSED=1
  mlp_row nodes 256,512,64 JAXVMM_GRAPH_FUSED=0
done
mlp_row fused 1024,512,64 JAXVMM_GRAPH_FUSED=1 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
mlp_row nodes 1024,512,64 JAXVMM_GRAPH_FUSED=0 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
gpu_tests graph 220 tests/test_graph.py tests/test_graph_xla.py
