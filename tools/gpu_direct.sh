#!/usr/bin/env bash
# Uncaptured reloads of a recorded size copy straight into XLA's buffer (no new staging cell):
# tools/peak_cells.py --from-start 4 --watch-first on the MLP and GPT hidden rows (platform allocator);
# the graph gpu tests and the offload/engine gpu tests with command buffers off and with XLA's default
# flags (JAXVMM_REQUIRE_GPU=1); then the two hidden rows with their whole-run and timed-step peaks.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for m in mlp gpt; do
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 80 python3 tools/peak_cells.py --model $m --from-start 4 --watch-first > "$OUT/fs_$m.txt" 2>&1
  echo "=== from start $m ($((SECONDS - T0)) s)"; head -5 "$OUT/fs_$m.txt"; grep -E "direct|Error" "$OUT/fs_$m.txt" | head -3
done
export JAXVMM_REQUIRE_GPU=1
ring_tests graph
gpu_tests offload 110 tests/test_offload.py
unset JAXVMM_REQUIRE_GPU
: > "$OUT/rows.txt"
hidden_rows mlp gpt
exit 0
