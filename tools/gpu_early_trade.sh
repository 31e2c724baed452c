#!/usr/bin/env bash
# Trades under a running D2H: the MLP-hidden and GPT MLP-hidden rows (save on device in the same run,
# driver-level timeline, 10 steps), jaxvmm's pages over one MLP step (tools/peak_cells.py), the 1 MiB
# MLP row in XLA's default and +WHILE modes, then with JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests
# (default mode; test_graph_xla covers every mode) and the offload and remat suites. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 tools/peak_cells.py --model mlp --bin-ms 8 > "$OUT/peak_mlp.txt" 2>&1
echo "=== peak_cells mlp ($((SECONDS - T0)) s)"; head -1 "$OUT/peak_mlp.txt"; awk 'NR>2 {print $3}' "$OUT/peak_mlp.txt" | sort | uniq -c
ROW_TIMEOUT=60 mlp_row "1MiB,default" 256,512,64
ROW_TIMEOUT=60 mlp_row "1MiB,+WHILE" 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests offload 120 tests/test_offload.py
remat_suite
exit 0
