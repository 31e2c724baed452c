#!/usr/bin/env bash
# Device call (2 GPUs): sharded arrays under plain jit (issue 9 item 5). Builds, then runs
# tests/test_sharded.py (2-GPU roundtrips and data-parallel / FSDP training steps, plus the 4-cpu-device
# cases in subprocesses) and the shard_map test; full logs in "$OUT".
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
nvidia-smi -L > "$OUT/gpus.txt" 2>&1; cat "$OUT/gpus.txt"
echo "=== 2-GPU sharded tests (gpu-marked, must not skip)"
JAXVMM_REQUIRE_GPU=1 timeout 300 python3 -P -m pytest -q -s -p no:cacheprovider -m gpu tests/test_sharded.py \
  "tests/test_offload.py::test_gpu_two_devices_shard_map" > "$OUT/gpu_shard.txt" 2>&1
echo "rc=$?"
grep -E "(dp|fsdp) (True|False) \{|^(FAILED|ERROR)|passed|failed|skipped" "$OUT/gpu_shard.txt" | tail -12
echo "=== 4 cpu devices, Shardy and GSPMD (subprocesses)"
timeout 280 python3 -P -m pytest -q -p no:cacheprovider -m "not gpu" tests/test_sharded.py > "$OUT/cpu_shard.txt" 2>&1
echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/cpu_shard.txt" | tail -6
