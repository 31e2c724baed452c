#!/usr/bin/env bash
# After the review of the reload kernel: the new gpu test (a reload the device took by value) against
# ab_old/ (passed in `carry`, the tree before: it must fail there) and this tree, then with
# JAXVMM_REQUIRE_GPU=1 the ring-path tests with command buffers off, the graph tests, and the other
# gpu-marked files in default mode. PART=2 instead: the offload and remat suites in default and +WHILE
# modes (SKIP_BUILD=1 on the warm machine). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
if [[ ${PART:-1} == 2 ]]; then
  for mode in default while; do
    flags=""; [[ $mode == while ]] && flags="--xla_gpu_enable_command_buffer=+WHILE"
    XLA_FLAGS="$flags" gpu_tests offload_$mode 150 tests/test_offload.py
    XLA_FLAGS="$flags" timeout 200 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/remat_$mode.txt" 2>&1
    echo "=== remat_$mode rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/remat_$mode.txt" | tail -1) ($((SECONDS - T0)) s)"
    grep -E "^(FAILED|ERROR)" "$OUT/remat_$mode.txt" | cut -c1-250 | head -6
  done
  exit 0
fi
ab_build
old bash -c "python3 -P -m pytest -q -rfs --tb=line -p no:cacheprovider -m gpu $AB_ROOT/tests/test_engine.py -k took_by_value" > "$OUT/byvalue_old.txt" 2>&1
echo "=== by-value test, old tree: $(tail -1 "$OUT/byvalue_old.txt") ($((SECONDS - T0)) s)"; grep -E "assert|Error" "$OUT/byvalue_old.txt" | cut -c1-300 | head -4
gpu_tests byvalue_new 120 tests/test_engine.py -k took_by_value
ring_tests graph
gpu_tests rest 200 $REST_TESTS
