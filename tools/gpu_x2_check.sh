#!/usr/bin/env bash
# Device call (nvidia-h200-x2), one pytest process at a time (parallel processes on the same two GPUs
# starved each other: NCCL rendezvous timeouts): shared slots and sharded arrays on 2 GPUs (data-
# parallel and FSDP training steps in plain jit), then ${EXTRA:-nothing else}. Logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
job() {  # job NAME TIMEOUT pytest-args...
  local name=$1 t=$2; shift 2
  timeout "$t" python3 -P -m pytest -v -rfs --tb=short -p no:cacheprovider "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name: rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/$name.txt" | tail -1)"
  grep -E "(FAILED|ERROR)" "$OUT/$name.txt" | cut -c1-250 | head -10
  grep -E "^E  " "$OUT/$name.txt" | cut -c1-300 | head -8
}
JAXVMM_REQUIRE_2GPU=1 job share 150 -m gpu tests/test_share.py
job sharded 200 -s -m gpu tests/test_sharded.py "tests/test_offload.py::test_gpu_two_devices_shard_map"
grep -E "(dp|fsdp) (True|False) \{" "$OUT/sharded.txt" | cut -c1-300 | head -6
[[ -n "${EXTRA:-}" ]] && job extra ${T_EXTRA:-200} -m gpu $EXTRA
exit 0
