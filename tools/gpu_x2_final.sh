#!/usr/bin/env bash
# Device call (nvidia-h200-x2): build; graph-mode tests; small-activation rows (default, +WHILE);
# shared slots on 2 GPUs; sharded arrays on 2 GPUs; the gpu-marked offload/engine/remat suite.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== graph tests"
timeout 100 python3 -P -m pytest -q -m gpu -rfs -s tests/test_graph.py tests/test_graph_xla.py > "$OUT/graph_tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/graph_tests.txt" | cut -c1-300 | tail -8
for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
  echo "=== small row, XLA_FLAGS='$mode'"
  XLA_FLAGS="$mode" timeout 80 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,native,jaxvmm --mlp-shape 256,512,64 --steps 20 --warmup 3 --timeout 60 > "$OUT/small_${mode:+while}.txt" 2>&1
  grep -E "^\| mlp|error" "$OUT/small_${mode:+while}.txt" | cut -c1-600 | head -6
done
echo "=== shared slots (2 GPUs)"
JAXVMM_REQUIRE_2GPU=1 timeout 90 python3 -P -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_share.py > "$OUT/share_tests.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/share_tests.txt" | cut -c1-300 | tail -8
echo "=== sharded (2 GPUs)"
timeout 120 python3 -P -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sharded.py \
  "tests/test_offload.py::test_gpu_two_devices_shard_map" > "$OUT/gpu_shard.txt" 2>&1
echo "rc=$?"; grep -E "(dp|fsdp) (True|False) \{|^(FAILED|ERROR)|passed|failed|skipped" "$OUT/gpu_shard.txt" | cut -c1-300 | tail -10
echo "=== gpu suite: offload, engine, remat, semantics, lifetimes, dtypes"
timeout ${T1:-150} python3 -P -m pytest -q -m gpu -rfs -p no:cacheprovider tests/test_offload.py tests/test_engine.py \
  tests/test_remat.py tests/test_semantics.py tests/test_lifetimes.py tests/test_dtypes.py > "$OUT/gpu_suite.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_suite.txt" | cut -c1-300 | tail -10
