#!/usr/bin/env bash
# The checks owed to the last session's review fixes (kept tickets, guard order, one retiring entry per
# size, displacement after the budget check): the graph, rest, offload and remat gpu suites with
# JAXVMM_REQUIRE_GPU=1 (default XLA flags); the MLP and GPT hidden rows with their timelines; the 1 MiB
# row; and tools/peak_cells.py --from-start 4 --watch-first on the MLP row (what is mapped through the
# first step). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph rest offload remat
: > "$OUT/rows.txt"
hidden_rows mlp gpt
from_start mlp
ROW_TIMEOUT=50 mlp_row 1MiB 256,512,64
exit 0
