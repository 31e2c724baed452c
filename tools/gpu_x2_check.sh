#!/usr/bin/env bash
# Device call (nvidia-h200-x2), everything in parallel: graph-mode tests; shared slots and sharded arrays
# on 2 GPUs (data-parallel and FSDP training steps); the gpu-marked offload/engine/remat/semantics/
# drop-in suite; and the remat/semantics/drop-in/flax files on jax's cpu platform (this machine's jax,
# newer than CI's). Logs under $OUT (7 files).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
job() {  # job NAME TIMEOUT pytest-args...
  local name=$1 t=$2; shift 2
  (timeout "$t" python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider "$@" > "$OUT/$name.txt" 2>&1
   echo "rc=$?" >> "$OUT/$name.txt") &
}
job graph 200 -m gpu tests/test_graph.py tests/test_graph_xla.py
JAXVMM_REQUIRE_2GPU=1 job share 150 -m gpu tests/test_share.py
job sharded 200 -s -m gpu tests/test_sharded.py "tests/test_offload.py::test_gpu_two_devices_shard_map"
job suite 300 -m gpu tests/test_offload.py tests/test_engine.py tests/test_remat.py tests/test_semantics.py \
  tests/test_lifetimes.py tests/test_dtypes.py tests/test_dropin.py
JAX_PLATFORMS=cpu job cpu_remat 300 tests/test_remat.py tests/test_semantics.py tests/test_dropin.py tests/test_flax.py
wait
for f in graph share sharded suite cpu_remat; do
  echo "=== $f: $(grep -E '^rc=' "$OUT/$f.txt") $(grep -E '(passed|failed|error).* in ' "$OUT/$f.txt" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/$f.txt" | cut -c1-250 | head -10
  grep -E "^E  " "$OUT/$f.txt" | cut -c1-300 | head -6
done
grep -E "(dp|fsdp) (True|False) \{" "$OUT/sharded.txt" | cut -c1-300 | head -6
