#!/usr/bin/env bash
# Held cells of large call sites (JAXVMM_DEBUG_GRAPH_HOLD): the large-activation rows with `spares` (the
# previous behaviour: a one-cell call site armed behind its D2H) against `large` (the default: held
# until the next round knocks, so the backward's first reload copies device to device), each
# invocation with save on device in the same run; then, with JAXVMM_REQUIRE_GPU=1, the graph-mode gpu
# tests (TESTS=0 skips them). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
big_row() {  # big_row HOLD MODEL TARGET [train_step args...]
  local hold=$1 model=$2 target=$3; shift 3
  JAXVMM_DEBUG_GRAPH_HOLD=$hold timeout 150 python3 bench/train_step.py --models "$model" --targets "$target" \
    --variants save,jaxvmm --steps "${STEPS:-10}" --warmup 3 --timeline --timeout 140 "$@" >> "$OUT/rows.txt" 2>&1
  echo "=== $model $target hold=$hold ($((SECONDS - T0)) s)"; grep -E "^\| $model" "$OUT/rows.txt" | tail -2 | cut -c1-420
}
for hold in ${HOLDS:-spares large}; do big_row "$hold" mlp mlp_hidden; done
for hold in ${HOLDS:-spares large}; do big_row "$hold" gpt mlp_hidden; done
[[ ${TESTS:-1} == 1 ]] && JAXVMM_REQUIRE_GPU=1 gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
exit 0
