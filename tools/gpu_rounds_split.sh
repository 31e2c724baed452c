#!/usr/bin/env bash
# What a graph-mode round's kernel time is made of (1 MiB row, jax.profiler): rounds as two nodes (the
# take kernel, which includes any wait for the poller's grant, and the copy kernel), and fused rounds
# with 4 cells per call site; then the 1 MiB row with 4 cells. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
prof() {  # prof NAME [env...]
  local name=$1; shift
  env "$@" timeout 120 python3 tools/round_profile.py --variant jaxvmm --shape 256,512,64 --dir /tmp/prof_$name > "$OUT/prof_$name.txt" 2>&1
  echo "=== profile $name $* ($((SECONDS - T0)) s)"; grep -E "^jaxvmm:|jaxvmm_|memcpy128|Memcpy" "$OUT/prof_$name.txt" | head -8
}
prof two_nodes JAXVMM_GRAPH_FUSED=0
prof cells4 JAXVMM_GRAPH_CELLS=4
mlp_row cells4 256,512,64 JAXVMM_GRAPH_CELLS=4
