#!/usr/bin/env bash
# The gpu suites in XLA's other command-buffer modes (JAXVMM_REQUIRE_GPU=1): tests/test_graph.py, the
# offload suite and the remat suite with `+WHILE`, then with command buffers off. test_graph_xla.py
# covers every mode itself and runs in the default-mode call (tools/gpu_trades.sh). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for mode in while off; do
  case $mode in
    while) export XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE ;;
    off) export XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
  esac
  gpu_tests "graph_$mode" 170 tests/test_graph.py
  gpu_tests "offload_$mode" 120 tests/test_offload.py
  remat_suite "remat_$mode"
done
exit 0
