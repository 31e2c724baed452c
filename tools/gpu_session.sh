#!/usr/bin/env bash
# One device call (nvidia-h200, ~9 min): build; the gpu tests this session touched, serially (graph mode
# and kernel grants, XLA command-buffer modes, host store, memory timeline, the driver-level engine
# tests); the small-activation row in default and +WHILE modes; offload bandwidth for both host stores;
# the capacity benchmark in quick mode with whatever time is left.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== gpu tests"
timeout ${T_TESTS:-170} python3 -P -m pytest -q -rfs --tb=line -p no:cacheprovider -m gpu tests/test_graph.py tests/test_graph_xla.py tests/test_graph_kernels_ptx.py \
  tests/test_host_store.py tests/test_memory.py \
  "tests/test_offload.py::test_peak_mapped_bytes_bounded_by_prefetch_depth" tests/test_offload.py::test_gpu_thousand_cycles_do_not_grow \
  tests/test_engine.py::test_gpu_idle_engine_returns_staging_pages_to_the_driver \
  tests/test_engine.py::test_gpu_offload_storm_stays_within_depth_cells tests/test_semantics.py::test_policies_mirror_jax_names \
  > "$OUT/tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^/.*Error" "$OUT/tests.txt" | cut -c1-400 | tail -14
for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
  echo "=== small row, XLA_FLAGS='$mode'"
  XLA_FLAGS="$mode" timeout 80 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,native,jaxvmm --mlp-shape 256,512,64 --steps 20 --warmup 3 --timeout 60 > "$OUT/small_${mode:+while}.txt" 2>&1
  grep -E "^\| mlp|error|Error" "$OUT/small_${mode:+while}.txt" | cut -c1-600 | head -6
done
echo "=== offload_bw"
timeout 100 python3 bench/offload_bw.py --sizes 1G --iters 8 --host-store pinned,host_numa --markdown --out "$OUT/bw.md" \
  > "$OUT/bw.txt" 2>&1; echo "rc=$?"
grep -E "^\||UNAVAILABLE|failed|DIFFERS|engine at the end|Error" "$OUT/bw.txt" | cut -c1-300 | head -40
[[ "${T_CAP:-150}" == 0 ]] && exit 0
echo "=== capacity (quick)"
timeout ${T_CAP:-150} python3 bench/capacity.py --quick --markdown --out "$OUT/capacity.md" --json "$OUT/capacity.json" \
  > "$OUT/capacity.txt" 2>&1; echo "rc=$?"
tail -30 "$OUT/capacity.txt" | cut -c1-300
