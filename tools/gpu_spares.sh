#!/usr/bin/env bash
# Spare cells (graph_spares) on the H200, one call (~9 minutes): the graph-mode gpu tests with 8 spares
# per offload call site; then the small-activation rows (4 MiB and 1 MiB per offload) with 0 / 16 / 32
# spares, default XLA flags and +WHILE, save on device in the same run as each jaxvmm row. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
JAXVMM_GRAPH_SPARES=8 gpu_tests graph_spares8 150 tests/test_graph.py tests/test_graph_xla.py
row() {  # row SHAPE SPARES XLA_FLAGS
  JAXVMM_GRAPH_SPARES=$2 XLA_FLAGS="$3" timeout 60 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --mlp-shape $1 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 55 >> "$OUT/rows.txt" 2>&1
  echo "=== row $1 spares=$2 XLA_FLAGS='$3' ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-400
}
: > "$OUT/rows.txt"
row 1024,512,64 0 ""
row 1024,512,64 32 ""
row 1024,512,64 16 ""
row 256,512,64 0 ""
row 256,512,64 16 ""
row 1024,512,64 32 "--xla_gpu_enable_command_buffer=+WHILE"
row 1024,512,64 0 "--xla_gpu_enable_command_buffer=+WHILE"
(( SECONDS - T0 < 480 )) && row 1024,512,64 64 ""
(( SECONDS - T0 < 520 )) && row 256,1024,64 16 ""
