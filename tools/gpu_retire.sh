#!/usr/bin/env bash
# Ring cells retired when a call site is recorded: tools/peak_cells.py --from-start 5 (MLP and GPT
# hidden rows, platform allocator), then the graph-mode gpu tests (every XLA mode) with
# JAXVMM_REQUIRE_GPU=1. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for m in mlp gpt; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 80 python3 tools/peak_cells.py --model $m --from-start 5 > "$OUT/fs_$m.txt" 2>&1
  echo "=== from start $m ($((SECONDS - T0)) s)"; tail -6 "$OUT/fs_$m.txt"
done
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 170 tests/test_graph.py tests/test_graph_xla.py
exit 0
