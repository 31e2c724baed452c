#!/usr/bin/env bash
# One device call that re-checks what changed since the last GPU run: the gpu tests of the graph path,
# the drop-in and the storm; the small-activation rows (1 MiB, 4 MiB, D=1024) in default and +WHILE
# modes; and a capacity trial for jaxvmm (names) at ${CAP_START:-25} layers. Logs under $OUT (4 files).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== gpu tests"
timeout ${T_TESTS:-220} python3 -P -m pytest -q -rfs --tb=short --timeout=60 -p no:cacheprovider -m gpu \
  tests/test_graph.py tests/test_graph_xla.py tests/test_dropin.py \
  tests/test_engine.py::test_gpu_offload_storm_stays_within_depth_cells > "$OUT/tests.txt" 2>&1; echo "rc=$?"
grep -E "FAILED|ERROR|passed|failed|Timeout" "$OUT/tests.txt" | cut -c1-220 | tail -20
: > "$OUT/rows.txt"
for shape in ${SHAPES:-256,512,64 1024,512,64 256,1024,64}; do
  for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
    echo "=== shape $shape XLA_FLAGS='$mode'" | tee -a "$OUT/rows.txt"
    XLA_FLAGS="$mode" timeout 70 python3 bench/train_step.py --models mlp --targets mlp_hidden \
      --variants save,native,jaxvmm --mlp-shape "$shape" --steps 20 --warmup 3 --timeout 60 >> "$OUT/rows.txt" 2>&1
    grep -E "^\| mlp" "$OUT/rows.txt" | tail -1 | cut -c1-400
  done
done
if [[ -n "${CAP_START-25}" ]]; then
  echo "=== capacity"
  timeout ${T_CAP:-170} python3 bench/capacity.py --policies jaxvmm-hidden --start ${CAP_START:-25} \
    --max ${CAP_MAX:-28} --precision 2 --time-limit ${T_CAP_IN:-160} > "$OUT/capacity.txt" 2>&1
  tail -25 "$OUT/capacity.txt"
fi
