#!/usr/bin/env bash
# Misses served from the offload cell (a small call site's first backward reloads read device to device):
# tools/step_counters.py on the 1 MiB row (graph_offload_cell_reads per step), then the 1 MiB row (and
# the 2 MiB D=1024 row) alternating the tree before (ab_old/, installed into /tmp/ab_old) and this one
# in one run; then the graph, offload and remat gpu suites (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
timeout 60 python3 tools/step_counters.py --steps 4 --watch > "$OUT/step_counters.txt" 2>&1
echo "=== step_counters ($((SECONDS - T0)) s)"; tail -8 "$OUT/step_counters.txt" | cut -c1-400
ab_row() {  # ab_row old|new SHAPE [FLAGS]
  local v=$1 shape=$2 flags=${3:-}
  $v env XLA_FLAGS="$flags" bash -c "timeout 55 python3 \$T/bench/train_step.py --models mlp --targets mlp_hidden --mlp-shape $shape \
    --variants save,jaxvmm --steps 20 --warmup 3 --timeout 50" >> "$OUT/rows_$v.txt" 2>&1
  echo "=== $v $shape $flags ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows_$v.txt" | tail -1 | cut -c1-120
}
for i in 1 2 3; do ab_row old 256,512,64; ab_row new 256,512,64; done
ab_row old 256,512,64 --xla_gpu_enable_command_buffer=+WHILE; ab_row new 256,512,64 --xla_gpu_enable_command_buffer=+WHILE
ab_row old 256,1024,64; ab_row new 256,1024,64
gpu_suites graph offload remat
exit 0
