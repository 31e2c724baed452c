#!/usr/bin/env bash
# The first device call of the next session (nvidia-h200, <= ~9 minutes), checking on the H200 what this
# session fixed on cpu only: the 8 MiB graph-round test (Slot.write's staged copy) 5 times; the capacity
# trial of jaxvmm (names) at 27 layers (the staging janitor's driver-lock hang) with both allocators; the
# graph, offload, drop-in and engine gpu tests; then the capacity search in the time left. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for i in 1 2 3 4 5; do gpu_tests pageable 60 tests/test_graph.py -k "pageable or no_event"; done
trial() {  # trial POLICY N ALLOCATOR
  XLA_PYTHON_CLIENT_ALLOCATOR=$3 timeout 100 python3 -P tools/watchdog.py 88 bench/capacity.py --trial $1 $2 --budget 24G \
    > "$OUT/trial_$3.txt" 2>&1
  echo "=== trial $1 $2 $3 ($((SECONDS - T0)) s)"; grep -E "CAPACITY_RESULT|watchdog" "$OUT/trial_$3.txt" | cut -c1-700
  grep -B2 -A6 "_ZN6jaxvmm" "$OUT/trial_$3.txt" | grep -v "python3\|libpython\|OnSignal" | cut -c1-200 | head -30
}
trial jaxvmm-hidden 27 platform
trial jaxvmm-hidden 27 cuda_async
gpu_tests suite 240 tests/test_graph.py tests/test_graph_xla.py tests/test_offload.py tests/test_dropin.py tests/test_engine.py
LEFT=$(( 545 - (SECONDS - T0) ))
if (( LEFT > 90 )); then
  timeout $LEFT python3 bench/capacity.py --policies jaxvmm-hidden,jaxvmm-dots,native,remat,save --start 27 \
    --precision 4 --time-limit $(( LEFT - 15 )) --markdown > "$OUT/capacity.txt" 2>&1
  tail -14 "$OUT/capacity.txt" | cut -c1-300
fi
