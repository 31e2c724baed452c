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
capacity_trial dots26_w3 jaxvmm-dots 26 --warmup 3
gpu_tests offload 90 tests/test_offload.py
