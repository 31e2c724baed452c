#!/usr/bin/env bash
# A held cell whose ticket was reloaded elsewhere goes idle (its pages pass to the partner call site):
# tools/peak_cells.py --from-start 4 --watch-first on the GPT and MLP hidden rows (platform allocator);
# the graph gpu tests and the remat suite (JAXVMM_REQUIRE_GPU=1); then the two hidden rows with their
# whole-run and timed-step peaks. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
from_start gpt mlp
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
remat_suite
unset JAXVMM_REQUIRE_GPU
: > "$OUT/rows.txt"
hidden_rows gpt mlp
exit 0
