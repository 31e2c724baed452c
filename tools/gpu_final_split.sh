#!/usr/bin/env bash
# The session's last device call (<= ~7 minutes): after the review fixes of the engine split (the
# parts free their driver objects under the device's context; a failed free is a reported leak), the
# engine, graph and graph_xla gpu tests; the jaxvmm (dots) capacity trial at 26 layers with three
# warm-up steps (is its slow step the host pool's growth?); then the offload gpu suite. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests core 230 tests/test_engine.py tests/test_graph.py tests/test_graph_xla.py
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 110 python3 -P tools/watchdog.py 100 bench/capacity.py --trial jaxvmm-dots 26 \
  --budget 24G --warmup 3 > "$OUT/trial_dots26_w3.txt" 2>&1
echo "=== trial jaxvmm-dots 26, 3 warm-up steps ($((SECONDS - T0)) s)"; grep -E "CAPACITY_RESULT|watchdog" "$OUT/trial_dots26_w3.txt" | cut -c1-900
gpu_tests offload 90 tests/test_offload.py
