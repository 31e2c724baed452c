#!/usr/bin/env bash
# Session 33's second call (prepared in session 32): the spare budget in the gpu suites and at the PCIe limit.
# 1) test_graph_xla.py's training tests with JAXVMM_GRAPH_SPARE_BUDGET=256M in the environment (every
#    offload call site then has spares, capped at 256 MiB a device; the other graph tests assume none); 2) the GPT every-dot trial
#    (bench/capacity.py --trial jaxvmm-dots 16, 120 GiB budget) and the MLP-hidden row with budgets
#    BUDGETS (default "0 512M 1G"): step time against device memory where PCIe is the limit. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
JAXVMM_REQUIRE_GPU=1 JAXVMM_GRAPH_SPARE_BUDGET=256M gpu_tests budget_xla 300 tests/test_graph_xla.py -k "one_to_three or spare"
: > "$OUT/rows.txt"
for b in ${BUDGETS:-0 512M 1G}; do
  JAXVMM_GRAPH_SPARE_BUDGET=$b XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 150 python3 -P bench/capacity.py \
    --trial jaxvmm-dots 16 --budget 120G > "$OUT/dots_$b.txt" 2>&1
  echo "=== dots budget=$b ($((SECONDS - T0)) s)"; grep -E "CAPACITY_RESULT|Error" "$OUT/dots_$b.txt" | cut -c1-700
  JAXVMM_GRAPH_SPARE_BUDGET=$b timeout 100 python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --steps 10 --warmup 3 --timeline --timeout 90 >> "$OUT/rows.txt" 2>&1
  echo "=== mlp_hidden budget=$b ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-520
done
exit 0
