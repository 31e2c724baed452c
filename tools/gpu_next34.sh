#!/usr/bin/env bash
# Session 34's second call: first what failed in the first (synchronize() waits for the barrier of dying
# tokens; a graph test warms the fence before its idle timeout; the remat test compares one device's
# counters) with the lifetime tests, then the paths the first call does not cover. The ring-path
# gpu tests with command buffers off (offload + engine), the graph-mode gpu suites under XLA's +WHILE
# command buffers, then capacity trials at the edges of the 24 GiB budget for jaxvmm (names) and jaxvmm
# (dots) with page trades and held cells (the README's table was measured before them for dots).
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== built ($((SECONDS - T0)) s)"
gpu_suites remat
JAXVMM_REQUIRE_GPU=1 gpu_tests fixed 150 tests/test_lifetimes.py tests/test_graph.py -k "never_captured_go_back or dropped"
JAXVMM_REQUIRE_GPU=1 ring_tests
JAXVMM_REQUIRE_GPU=1 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE gpu_tests graph_while 320 tests/test_graph.py tests/test_graph_xla.py
for spec in ${TRIALS:-jaxvmm-hidden:29 jaxvmm-hidden:30 jaxvmm-dots:27 jaxvmm-dots:28}; do
  (( SECONDS - T0 > ${STOP_AT:-560} )) && break
  capacity_trial "${spec/:/_}" "${spec%%:*}" "${spec##*:}"
done
exit 0
