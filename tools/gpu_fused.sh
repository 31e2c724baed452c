#!/usr/bin/env bash
# One device call (~6-8 minutes on an H200): build; the graph-mode gpu tests (tests/test_graph.py, every
# test fused and two-node) and the K = 1..3 XLA training test; then the small-activation row (64 MLP
# layers, 1 MiB hidden activations, 128 rounds a step) with fused rounds (one kernel node) and two-node
# rounds (JAXVMM_GRAPH_FUSED=0), in XLA's default command-buffer mode and with +WHILE, after
# bench/graph_rounds.py (the rounds' own device time, both ways, without XLA).
# Usage: tools/gpu_fused.sh   (OUT=dir for the full logs; T_TESTS: seconds for the tests, default 300,
# 0 skips them; T_ROW: seconds per row, 90; FUSED: the settings to measure, default "1 0", empty: no
# rows). Tests and rows together may pass a 10-minute device call: run T_TESTS=0 and FUSED= apart.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
show() { grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Timeout|^E " "$1" | sed 's/^tests\///' | cut -c1-240 | tail -${2:-40}; }
if [[ "${T_TESTS:-300}" != 0 ]]; then
  echo "=== gpu tests: tests/test_graph.py (fused and two-node) + K = 1..3 under XLA"
  timeout ${T_TESTS:-300} python3 -P -m pytest -v -rfs --tb=short --timeout=200 -p no:cacheprovider -m gpu tests/test_graph.py \
    tests/test_graph_xla.py::test_rounds_of_one_to_three_cells_are_bit_exact -s > "$OUT/fused_tests.txt" 2>&1
  echo "rc=$?"; show "$OUT/fused_tests.txt" 60
  grep -E "^(default|while) (fused|two-node) K" "$OUT/fused_tests.txt" | cut -c1-400
fi
if [[ -n "${FUSED-1 0}" ]]; then
  echo "=== bench/graph_rounds.py: device time per round, fused against two-node (64 rounds of 1 MiB, and 256 KiB)"
  for size in 1M 256K; do
    timeout 60 python3 bench/graph_rounds.py --size $size --reps 40 > "$OUT/graph_rounds_$size.txt" 2>&1; echo "rc=$?"
    tail -5 "$OUT/graph_rounds_$size.txt"
  done
fi
for F in ${FUSED-1 0}; do
  for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
    f="$OUT/fused${F}${mode:+_while}.txt"
    echo "=== small row JAXVMM_GRAPH_FUSED=$F XLA_FLAGS='$mode'"
    JAXVMM_GRAPH_FUSED=$F XLA_FLAGS="$mode" timeout ${T_ROW:-90} python3 bench/train_step.py --models mlp --targets mlp_hidden \
      --mlp-shape 256,512,64 --variants save,jaxvmm --steps 30 --timeout 60 --out "$OUT/fused${F}${mode:+_while}.md" > "$f" 2>&1
    grep -E "^\| (mlp|model)|error|Error" "$f" | cut -c1-400 | head -4
  done
done
