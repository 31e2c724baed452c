#!/usr/bin/env bash
# The reload kernel (jaxvmm_ring_reload) against ab_old/ (passed in `carry`; the tree before it):
# ring_cost.py alternating N times (default 3), the new tree with JAXVMM_WORKER_SPIN_US=0 twice, then
# the ring-path gpu tests with command buffers off and the graph gpu tests (default mode). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
for i in 1 2; do
  for v in old new; do
    $v bash -c 'XLA_FLAGS=--xla_gpu_enable_command_buffer= JAXVMM_WORKER_SPIN_US=0 timeout 90 python3 "$T/tools/ring_cost.py"' > "$OUT/ring_s0_$v$i.txt" 2>&1
    echo "=== ring_cost spin=0 $v $i: $(tail -1 "$OUT/ring_s0_$v$i.txt") ($((SECONDS - T0)) s)"
  done
done
XLA_FLAGS=$OFF gpu_tests ring_off 200 tests/test_offload.py tests/test_engine.py
gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
