#!/usr/bin/env bash
# Uncaptured reloads of a recorded size copy straight into XLA's buffer (no new staging cell):
# tools/peak_cells.py --from-start 4 --watch-first on the MLP and GPT hidden rows (platform allocator);
# the graph gpu tests and the offload/engine gpu tests with command buffers off and with XLA's default
# flags (JAXVMM_REQUIRE_GPU=1); then the two hidden rows with their whole-run and timed-step peaks.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
from_start mlp gpt
export JAXVMM_REQUIRE_GPU=1
ring_tests graph
gpu_tests offload 110 tests/test_offload.py
unset JAXVMM_REQUIRE_GPU
: > "$OUT/rows.txt"
hidden_rows mlp gpt
exit 0
