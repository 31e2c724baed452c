#!/usr/bin/env bash
# Device call B (same warm nvidia-h200-x2, built by call A): sharded arrays on 2 GPUs, then the
# gpu-marked suite (ring path, offload/remat/engine) at default XLA flags.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
python3 -c "import jaxvmm" 2>/dev/null || { [[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc; python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1; }
echo "=== sharded (2 GPUs)"
timeout ${TS:-110} python3 -P -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sharded.py \
  "tests/test_offload.py::test_gpu_two_devices_shard_map" > "$OUT/gpu_shard.txt" 2>&1
echo "rc=$?"; grep -E "(dp|fsdp) (True|False) \{|^(FAILED|ERROR)|passed|failed|skipped" "$OUT/gpu_shard.txt" | cut -c1-300 | tail -10
echo "=== gpu suite"
timeout ${T1:-170} python3 -P -m pytest -q -m gpu -rfs -p no:cacheprovider tests -x \
  --deselect tests/test_graph_xla.py --ignore tests/test_share.py --ignore tests/test_sharded.py > "$OUT/gpu_suite.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_suite.txt" | cut -c1-300 | tail -10
