#!/usr/bin/env bash
# The polling workers (no host functions) against ab_old/ (passed in `carry`; the tree with host
# functions): ring_cost.py alternating N times (default 3), then the XLA test that hung with
# cuEventSynchronize workers (1 to 3 cells per site, default and +WHILE modes, both round kinds) REPS
# times (default 2), then the ring-path gpu tests with command buffers off. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
for i in $(seq "${REPS:-2}"); do
  gpu_tests hangk$i 150 tests/test_graph_xla.py -k one_to_three
done
XLA_FLAGS=$OFF gpu_tests ring_off 120 tests/test_offload.py tests/test_engine.py
