#!/usr/bin/env bash
# Trades under a running D2H: the MLP-hidden and GPT MLP-hidden rows (save on device in the same run,
# driver-level timeline, 10 steps), jaxvmm's pages over one MLP step (tools/peak_cells.py), the 1 MiB
# MLP row in XLA's default and +WHILE modes, then with JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests
# (default mode; test_graph_xla covers every mode) and the offload and remat suites. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
for m in mlp gpt; do
  timeout 120 python3 bench/train_step.py --models $m --targets mlp_hidden --variants save,jaxvmm --steps 10 \
    --warmup 3 --timeline --timeout 110 >> "$OUT/rows.txt" 2>&1
  echo "=== $m mlp_hidden ($((SECONDS - T0)) s)"; grep -E "^\| $m" "$OUT/rows.txt" | tail -2 | cut -c1-480
done
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 tools/peak_cells.py --model mlp --bin-ms 8 > "$OUT/peak_mlp.txt" 2>&1
echo "=== peak_cells mlp ($((SECONDS - T0)) s)"; head -1 "$OUT/peak_mlp.txt"; awk 'NR>2 {print $3}' "$OUT/peak_mlp.txt" | sort | uniq -c
ROW_TIMEOUT=60 mlp_row "1MiB,default" 256,512,64
ROW_TIMEOUT=60 mlp_row "1MiB,+WHILE" 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests offload 120 tests/test_offload.py
timeout 100 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/remat.txt" 2>&1
echo "=== remat rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/remat.txt" | tail -1) ($((SECONDS - T0)) s)"
grep -E "^(FAILED|ERROR)" "$OUT/remat.txt" | cut -c1-250 | head -6
exit 0
