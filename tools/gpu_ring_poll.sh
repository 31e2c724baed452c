#!/usr/bin/env bash
# The polling workers (no host functions) against ab_old/ (passed in `carry`; the tree with host
# functions): ring_cost.py alternating N times (default 3), then the XLA test that hung with
# cuEventSynchronize workers (1 to 3 cells per site, default and +WHILE modes, both round kinds) REPS
# times (default 2), then the ring-path gpu tests with command buffers off. Logs under $OUT.
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
for i in $(seq "${REPS:-2}"); do
  gpu_tests hangk$i 150 tests/test_graph_xla.py -k one_to_three
done
XLA_FLAGS=$OFF gpu_tests ring_off 120 tests/test_offload.py tests/test_engine.py
