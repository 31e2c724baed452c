#!/usr/bin/env bash
# Page trades between large call sites: the MLP-hidden and GPT MLP-hidden rows (save on device in the
# same run, driver-level timeline), jaxvmm's pages over one MLP step (tools/peak_cells.py), then with
# JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests, the other gpu files and the offload and remat suites.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 tools/peak_cells.py --model mlp --bin-ms 8 > "$OUT/peak_mlp.txt" 2>&1
echo "=== peak_cells mlp ($((SECONDS - T0)) s)"; head -1 "$OUT/peak_mlp.txt"; awk 'NR>2 {print $3}' "$OUT/peak_mlp.txt" | sort | uniq -c
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests rest 150 tests/test_engine.py tests/test_dtypes.py tests/test_host_store.py tests/test_memory.py tests/test_semantics.py tests/test_share.py tests/test_slots.py
gpu_tests offload 120 tests/test_offload.py
remat_suite
exit 0
