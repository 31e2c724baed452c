#!/usr/bin/env bash
# The ring path's final check (host functions kept, copy kernel, no `ready` memop for predicted
# reloads): ring_cost.py A/B against ab_old/ (passed in `carry`) alternating N times, a traced
# breakdown of this tree, then the ring-path gpu tests with command buffers off and the graph gpu tests
# in default mode (where the worker-waits variant hung). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_old ./ab_old > "$OUT/build_old.txt" 2>&1 || { tail -20 "$OUT/build_old.txt"; exit 1; }
ROOT=$PWD
old() { (cd /tmp && T=$ROOT/ab_old PYTHONPATH=/tmp/ab_old "$@"); }
new() { (cd /tmp && T=$ROOT "$@"); }
for i in $(seq "${N:-3}"); do
  for v in old new; do
    $v bash -c 'XLA_FLAGS='$OFF' timeout 90 python3 "$T/tools/ring_cost.py"' > "$OUT/ring_$v$i.txt" 2>&1
    echo "=== ring_cost $v $i: $(tail -1 "$OUT/ring_$v$i.txt") ($((SECONDS - T0)) s)"
  done
done
XLA_FLAGS=$OFF JAXVMM_TRACE=1 timeout 120 python3 tools/ring_cost.py --reps 20 > "$OUT/ring_traced.txt" 2> "$OUT/ring_trace.txt"
timeout 60 python3 tools/ring_cost.py --reps 20 --trace "$OUT/ring_trace.txt" > "$OUT/ring_breakdown.txt" 2>&1
echo "=== breakdown ($((SECONDS - T0)) s)"; head -20 "$OUT/ring_breakdown.txt"
XLA_FLAGS=$OFF gpu_tests ring_off 150 tests/test_offload.py tests/test_engine.py
gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
