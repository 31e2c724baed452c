#!/usr/bin/env bash
# The ring path after the reload kernel and the staging/host-pool fixes, against ab_old/ (passed in
# `carry`): ring_cost.py alternating N times (default 3), one profiled run of this tree, then the
# ring-path gpu tests (command buffers off) and the graph gpu tests (default mode). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
XLA_FLAGS=$OFF JAXVMM_RING_PROFILE=1 timeout 90 python3 tools/ring_cost.py > "$OUT/prof.txt" 2>&1
echo "=== profile ($((SECONDS - T0)) s)"; tail -3 "$OUT/prof.txt"
XLA_FLAGS=$OFF gpu_tests ring_off 200 tests/test_offload.py tests/test_engine.py
[[ -n ${GRAPH:-1} ]] && gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
