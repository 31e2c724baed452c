#!/usr/bin/env bash
# The ring path's final check (host functions kept, copy kernel, no `ready` memop for predicted
# reloads): ring_cost.py A/B against ab_old/ (passed in `carry`) alternating N times, a traced
# breakdown of this tree, then the ring-path gpu tests with command buffers off and the graph gpu tests
# in default mode (where the worker-waits variant hung). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
XLA_FLAGS=$OFF JAXVMM_TRACE=1 timeout 120 python3 tools/ring_cost.py --reps 20 > "$OUT/ring_traced.txt" 2> "$OUT/ring_trace.txt"
timeout 60 python3 tools/ring_cost.py --reps 20 --trace "$OUT/ring_trace.txt" > "$OUT/ring_breakdown.txt" 2>&1
echo "=== breakdown ($((SECONDS - T0)) s)"; head -20 "$OUT/ring_breakdown.txt"
XLA_FLAGS=$OFF gpu_tests ring_off 150 tests/test_offload.py tests/test_engine.py
gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
