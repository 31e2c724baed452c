#!/usr/bin/env bash
# Device call (nvidia-h200-x2): build, then the sharded 2-GPU tests and the gpu-marked suite subset.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
echo "=== sharded (2 GPUs)"
timeout 90 python3 -P -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sharded.py \
  "tests/test_offload.py::test_gpu_two_devices_shard_map" > "$OUT/gpu_shard.txt" 2>&1
echo "rc=$?"; grep -E "(dp|fsdp) (True|False) \{|^(FAILED|ERROR)|passed|failed|skipped" "$OUT/gpu_shard.txt" | cut -c1-300 | tail -10
echo "=== gpu suite subset"
timeout ${T1:-170} python3 -P -m pytest -q -m gpu -rfs -p no:cacheprovider tests/test_offload.py tests/test_engine.py \
  tests/test_remat.py tests/test_semantics.py tests/test_lifetimes.py tests/test_graph.py > "$OUT/gpu_suite.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_suite.txt" | cut -c1-300 | tail -10
