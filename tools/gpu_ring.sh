#!/usr/bin/env bash
# Ring-path handler host time with the copy kernel (tools/ring_cost.py, command buffers off;
# JAXVMM_GRAPH_KERNELS=0 keeps driver copies: the A/B of the kernel), a traced run for the per-call
# breakdown, and the 1 MiB row with command buffers off and in default mode. TESTS=1 instead (e.g. a
# second call on the warm machine with SKIP_BUILD=1): the ring-path gpu tests with command buffers off
# and the graph gpu tests. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
if [[ -n ${TESTS:-} ]]; then
  ring_tests graph
  exit 0
fi
for v in 1 0 1 0; do
  XLA_FLAGS=$OFF JAXVMM_GRAPH_KERNELS=$v timeout 90 python3 tools/ring_cost.py > "$OUT/ring_cost_k$v.txt" 2>&1
  echo "=== ring_cost kernels=$v: $(tail -1 "$OUT/ring_cost_k$v.txt") ($((SECONDS - T0)) s)"
done
ring_breakdown
: > "$OUT/rows.txt"
mlp_row off 256,512,64 XLA_FLAGS=$OFF
mlp_row default 256,512,64
