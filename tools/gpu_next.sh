#!/usr/bin/env bash
# The next session's first device call (nvidia-h200, <= ~6 minutes), checking what this session changed
# after its last GPU run: comments only in graph_mode.cc, jaxvmm.reserve_host (cpu-tested) and
# capacity.py's --reserve-host. The engine and graph gpu tests, then the jaxvmm (dots) capacity trial at
# 26 layers with a step's worth of host memory pinned first (last session, without it: 1.94 s and
# 1.11 s for the steps after the first, then 0.64 s; with it the first steps should be near 0.64 s).
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests core 230 tests/test_engine.py tests/test_graph.py tests/test_graph_xla.py
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 110 python3 -P tools/watchdog.py 100 bench/capacity.py --trial jaxvmm-dots 26 \
  --budget 24G --warmup 3 --reserve-host 14G > "$OUT/trial_dots26_reserved.txt" 2>&1
echo "=== trial jaxvmm-dots 26, 14G reserved ($((SECONDS - T0)) s)"; grep -E "CAPACITY_RESULT|watchdog|Error" "$OUT/trial_dots26_reserved.txt" | cut -c1-900
