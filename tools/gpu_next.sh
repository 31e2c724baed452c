#!/usr/bin/env bash
# The next session's first device call (nvidia-h200, ~5 min): a baseline of this head to A/B the
# reverted "reloads from offload cells" against (commits 08e1a32 and cb8d2b7; export each to its own
# tree and run this script there too): three profiles of the 1 MiB row (each kernel's longest rounds:
# the backward's first two reloads waited 58/35 us without the feature, 73/<3 with 08e1a32 and
# 112-120/49-96 with cb8d2b7, one profile each run), graph_rounds at 1 MiB, three 1 MiB rows, and the
# ring path's handler cost. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for i in 1 2 3; do round_prof "$i" jaxvmm; done
timeout 60 python3 bench/graph_rounds.py --reps 40 > "$OUT/rounds.txt" 2>&1; grep -E "^\|" "$OUT/rounds.txt" | tail -2
: > "$OUT/rows.txt"
for i in 1 2 3; do mlp_row base 256,512,64; done
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 60 python3 tools/ring_cost.py > "$OUT/ring_cost.txt" 2>&1; tail -2 "$OUT/ring_cost.txt"
