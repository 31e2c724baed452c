#!/usr/bin/env bash
# A held cell whose ticket was reloaded elsewhere goes idle (its pages pass to the partner call site):
# tools/peak_cells.py --from-start 4 --watch-first on the GPT and MLP hidden rows (platform allocator);
# the graph gpu tests and the remat suite (JAXVMM_REQUIRE_GPU=1); then the two hidden rows with their
# whole-run and timed-step peaks. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for m in gpt mlp; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 80 python3 tools/peak_cells.py --model $m --from-start 4 --watch-first > "$OUT/fs_$m.txt" 2>&1
  echo "=== from start $m ($((SECONDS - T0)) s)"; head -5 "$OUT/fs_$m.txt"; grep -E "Error" "$OUT/fs_$m.txt" | head -3
done
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
remat_suite
unset JAXVMM_REQUIRE_GPU
: > "$OUT/rows.txt"
hidden_rows gpt mlp
exit 0
