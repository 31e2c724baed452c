#!/usr/bin/env bash
# One device call (nvidia-h200, <= ~8 minutes): build; the pageable-fallback test 3 times; the graph-mode
# gpu tests; the offload and drop-in gpu tests; the capacity trial of jaxvmm (names) at 27 layers; then,
# time permitting, trials of full remat and jaxvmm (names) at 27 layers with XLA's cuda_async allocator.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
t() {  # t NAME TIMEOUT pytest-args...
  local name=$1 to=$2; shift 2
  timeout "$to" python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider -m gpu "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/$name.txt" | tail -1) ($((SECONDS - T0)) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.txt" | cut -c1-250 | head -8; grep -E "^E  " "$OUT/$name.txt" | cut -c1-300 | head -6
}
for i in 1 2 3; do t pageable 60 tests/test_graph.py -k "pageable or no_event"; done
t graph 200 tests/test_graph.py tests/test_graph_xla.py
t suite 200 tests/test_offload.py tests/test_dropin.py
trial() {  # trial POLICY N ALLOCATOR
  XLA_PYTHON_CLIENT_ALLOCATOR=$3 timeout 100 python3 -P tools/watchdog.py 88 bench/capacity.py --trial $1 $2 --budget 24G \
    > "$OUT/trial_$1_$3.txt" 2>&1
  echo "=== trial $1 $2 $3 ($((SECONDS - T0)) s)"
  grep -E "CAPACITY_RESULT|watchdog" "$OUT/trial_$1_$3.txt" | cut -c1-700
}
trial jaxvmm-hidden 27 platform
if (( SECONDS - T0 < 400 )); then trial remat 27 cuda_async; trial jaxvmm-hidden 27 cuda_async; fi
