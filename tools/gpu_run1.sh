#!/usr/bin/env bash
# Device call 1: build, smoke, the whole suite with GPU skips as failures, offload bandwidth.
set -uo pipefail
export OUT=${OUT:-out}
STEPS="smoke tests offload" TAIL=40 bash tools/gpu_check.sh
# The offload and engine suites again with command buffers off and with +WHILE (the handlers are not
# command-buffer compatible yet, so XLA must leave them out of graphs in every mode).
for flags in "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1"; do
  echo "=== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" JAXVMM_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -P -m pytest -q -x tests/test_engine.py tests/test_offload.py -k "gpu or cuda" 2>&1 | tail -5
done
