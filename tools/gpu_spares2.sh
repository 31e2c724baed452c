#!/usr/bin/env bash
# Spare cells, second call: lends only while more graph D2Hs are queued than the channel has cells. The
# 4 MiB and 1 MiB rows with graph_cells 2 / 4 and 0 / 64 spares, then the graph-mode gpu tests with 8
# spares. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
row() {  # row SHAPE CELLS SPARES XLA_FLAGS
  JAXVMM_GRAPH_CELLS=$2 JAXVMM_GRAPH_SPARES=$3 XLA_FLAGS="$4" timeout 60 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --mlp-shape $1 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 55 >> "$OUT/rows.txt" 2>&1
  echo "=== row $1 cells=$2 spares=$3 XLA_FLAGS='$4' ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-400
}
: > "$OUT/rows.txt"
row 1024,512,64 2 64 ""
row 1024,512,64 4 64 ""
row 1024,512,64 4 0 ""
row 256,512,64 2 64 ""
row 256,512,64 4 64 ""
row 1024,512,64 4 64 "--xla_gpu_enable_command_buffer=+WHILE"
JAXVMM_GRAPH_SPARES=8 gpu_tests graph_spares8 150 tests/test_graph.py tests/test_graph_xla.py
