#!/usr/bin/env bash
# One device call (nvidia-h200, ~5 min): reloads served from the offload cells that still hold their
# bytes (graph_cell_reads): the graph and graph_xla gpu tests, the 1 MiB profile (do the backward's first
# reloads still wait?), the small rows. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
timeout 100 python3 tools/round_profile.py --variant jaxvmm --shape 256,512,64 --dir /tmp/prof_c > "$OUT/prof_cells.txt" 2>&1
echo "=== profile ($((SECONDS - T0)) s)"; grep -E "jaxvmm_take|longest|span|engine:" "$OUT/prof_cells.txt" | head -12
: > "$OUT/rows.txt"
mlp_row cells 256,512,64
mlp_row cells 256,512,64
mlp_row cells_w 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
mlp_row cells 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64
