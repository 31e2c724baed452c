#!/usr/bin/env bash
# Device call: build, the gpu-marked tests (JAXVMM_REQUIRE_GPU=1) at XLA's default flags, then the
# offload/engine/remat GPU tests with command buffers off and with +WHILE.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== gpu tests, default XLA flags"
timeout ${T1:-330} python3 -P -m pytest -q -m gpu -rfs --durations=8 tests > "$OUT/gpu_tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|slowest|^[0-9.]+s " "$OUT/gpu_tests.txt" | tail -25
for flags in "--xla_gpu_enable_command_buffer=" "--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1"; do
  echo "=== XLA_FLAGS=$flags"
  XLA_FLAGS="$flags" timeout ${T2:-90} python3 -P -m pytest -q -m gpu tests/test_engine.py tests/test_offload.py tests/test_remat.py -k "not thousand and not two_devices" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -8
done
