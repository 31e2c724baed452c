#!/usr/bin/env bash
# No pages before a trading call site's first round: the MLP-hidden and GPT MLP-hidden rows (save on
# device in the same run, 10 steps, driver-level timeline over the run and over the timed steps),
# tools/peak_cells.py --from-start 6 (MLP), then with JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests and
# the offload and remat suites. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 tools/peak_cells.py --model mlp --from-start 6 > "$OUT/fs_mlp.txt" 2>&1
echo "=== from start ($((SECONDS - T0)) s)"; tail -7 "$OUT/fs_mlp.txt"
gpu_suites graph offload remat
exit 0
