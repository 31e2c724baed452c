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
capacity_trial dots26_reserved jaxvmm-dots 26 --warmup 3 --reserve-host 14G
