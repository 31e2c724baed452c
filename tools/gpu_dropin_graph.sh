#!/usr/bin/env bash
# Device call (nvidia-h200): build; the eager-vmap counter question; graph-mode tests (Replay + XLA modes);
# the drop-in checkpoint's gpu twins; the gpu-marked offload/engine files with their slowest tests named.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== eager vmap counters"
timeout 60 python3 tools/gpu_vmap_debug.py > "$OUT/vmap.txt" 2>&1; echo "rc=$?"; head -3 "$OUT/vmap.txt" | cut -c1-700
echo "=== graph tests"
timeout 120 python3 -P -m pytest -q -m gpu -rfs -p no:cacheprovider tests/test_graph.py tests/test_graph_xla.py > "$OUT/graph_tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/graph_tests.txt" | cut -c1-300 | tail -8
echo "=== drop-in (gpu twins)"
timeout 120 python3 -P -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_dropin.py > "$OUT/dropin_gpu.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dropin_gpu.txt" | cut -c1-300 | tail -12
echo "=== gpu suite: offload, engine"
timeout ${T1:-190} python3 -P -m pytest -q -m gpu -rfs -p no:cacheprovider --durations=12 tests/test_offload.py tests/test_engine.py \
  > "$OUT/gpu_suite1.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^[0-9.]+s (call|setup)" "$OUT/gpu_suite1.txt" | cut -c1-300 | tail -30
