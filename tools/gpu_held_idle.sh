#!/usr/bin/env bash
# A held cell whose ticket was reloaded elsewhere goes idle (its pages pass to the partner call site):
# tools/peak_cells.py --from-start 4 --watch-first on the GPT and MLP hidden rows (platform allocator);
# the graph gpu tests and the remat suite (JAXVMM_REQUIRE_GPU=1); then the two hidden rows with their
# whole-run and timed-step peaks. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
from_start gpt mlp
gpu_suites graph remat
: > "$OUT/rows.txt"
hidden_rows gpt mlp
exit 0
