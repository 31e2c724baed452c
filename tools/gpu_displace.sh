#!/usr/bin/env bash
# Graph cells displacing idle ring cells: the MLP-hidden and GPT MLP-hidden rows (save on device in the
# same run, driver-level timeline over the whole run and over the timed steps, 10 steps), then with
# JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests, the other gpu files, the offload and remat suites.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests rest 150 $REST_TESTS
gpu_tests offload 120 tests/test_offload.py
remat_suite
exit 0
