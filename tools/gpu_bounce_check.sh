#!/usr/bin/env bash
# One device call (nvidia-h200, <= ~8 minutes): build; the pageable-fallback test 3 times; the graph-mode
# gpu tests; the offload and drop-in gpu tests; the capacity trial of jaxvmm (names) at 27 layers; then,
# time permitting, trials of full remat and jaxvmm (names) at 27 layers with XLA's cuda_async allocator.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for i in 1 2 3; do gpu_tests pageable 60 tests/test_graph.py -k "pageable or no_event"; done
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests suite 200 tests/test_offload.py tests/test_dropin.py
trial() {  # trial POLICY N ALLOCATOR
  XLA_PYTHON_CLIENT_ALLOCATOR=$3 timeout 100 python3 -P tools/watchdog.py 88 bench/capacity.py --trial $1 $2 --budget 24G \
    > "$OUT/trial_$1_$3.txt" 2>&1
  echo "=== trial $1 $2 $3 ($((SECONDS - T0)) s)"
  grep -E "CAPACITY_RESULT|watchdog" "$OUT/trial_$1_$3.txt" | cut -c1-700
}
trial jaxvmm-hidden 27 platform
if (( SECONDS - T0 < 400 )); then trial remat 27 cuda_async; trial jaxvmm-hidden 27 cuda_async; fi
