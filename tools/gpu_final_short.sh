#!/usr/bin/env bash
# Short device call: build; the small-activation row (save vs jaxvmm with kernel grants) in default and
# +WHILE modes; then this session's gpu tests verbosely with a per-test time limit.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
  echo "=== small row, XLA_FLAGS='$mode'"
  XLA_FLAGS="$mode" timeout 70 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --mlp-shape 256,512,64 --steps 20 --warmup 3 --timeout 60 > "$OUT/small_${mode:+while}.txt" 2>&1
  grep -E "^\| mlp|error|Error" "$OUT/small_${mode:+while}.txt" | cut -c1-700 | head -4
done
echo "=== gpu tests"
timeout ${T_TESTS:-150} python3 -P -m pytest -v -rfs --tb=line --timeout=45 -p no:cacheprovider -m gpu tests/test_graph.py \
  tests/test_graph_xla.py tests/test_host_store.py tests/test_memory.py \
  "tests/test_offload.py::test_peak_mapped_bytes_bounded_by_prefetch_depth" \
  tests/test_engine.py::test_gpu_idle_engine_returns_staging_pages_to_the_driver \
  tests/test_engine.py::test_gpu_offload_storm_stays_within_depth_cells > "$OUT/tests.txt" 2>&1; echo "rc=$?"
grep -E "FAILED|ERROR|PASSED|passed|failed|Timeout|^/.*Error|^E " "$OUT/tests.txt" | sed 's/^tests\///' | cut -c1-220 | tail -45
