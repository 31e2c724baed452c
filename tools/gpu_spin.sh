#!/usr/bin/env bash
# Does the workers' spinning poll slow the handlers' driver calls? tools/ring_cost.py (command buffers
# off) alternating JAXVMM_WORKER_SPIN_US=50 (the default) and 0 (naps only), N times (default 3), a
# traced breakdown; then (TESTS=1) the ring-path gpu tests with command buffers off and the graph gpu
# tests in default mode. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
for i in $(seq "${N:-3}"); do
  for s in 50 0; do
    XLA_FLAGS=$OFF JAXVMM_WORKER_SPIN_US=$s timeout 90 python3 tools/ring_cost.py > "$OUT/ring_s$s.$i.txt" 2>&1
    echo "=== ring_cost spin=$s #$i: $(tail -1 "$OUT/ring_s$s.$i.txt") ($((SECONDS - T0)) s)"
  done
done
XLA_FLAGS=$OFF JAXVMM_TRACE=1 timeout 120 python3 tools/ring_cost.py --reps 20 > "$OUT/ring_traced.txt" 2> "$OUT/ring_trace.txt"
timeout 60 python3 tools/ring_cost.py --reps 20 --trace "$OUT/ring_trace.txt" > "$OUT/ring_breakdown.txt" 2>&1
echo "=== breakdown ($((SECONDS - T0)) s)"; head -22 "$OUT/ring_breakdown.txt"
if [[ -n ${TESTS:-} ]]; then
  XLA_FLAGS=$OFF gpu_tests ring_off 200 tests/test_offload.py tests/test_engine.py
  gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
fi
