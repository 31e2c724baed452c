#!/usr/bin/env bash
# One device call (~4-5 minutes on an H200): build; the graph-mode gpu tests of K cells per channel;
# the small-activation row (64 MLP layers, 1 MiB hidden activations, 128 rounds a step) with K = 1 (the
# single-cell protocol) and K = 2 (the default), in XLA's default command-buffer mode and with +WHILE;
# then the every-mode XLA training test (runs with the default K = 2) in the time left.
# Usage: tools/gpu_cells.sh   (OUT=dir for the full logs; CELLS="1 2 3" for more rows; T_TESTS / T_XLA:
# seconds for the two test runs, default 80 / 80, T_XLA=0 skips the second; T_ROW: seconds per row, 90)
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
show() { grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Timeout|^E " "$1" | sed 's/^tests\///' | cut -c1-240 | tail -${2:-40}; }
echo "=== gpu tests: tests/test_graph.py + the 32-iteration scan with K = 2"
timeout ${T_TESTS:-80} python3 -P -m pytest -v -rfs --tb=short --timeout=60 -p no:cacheprovider -m gpu tests/test_graph.py \
  tests/test_graph_xla.py::test_scan_of_32_with_two_cells_takes_most_grants_on_the_device -s > "$OUT/cells_tests.txt" 2>&1
echo "rc=$?"; show "$OUT/cells_tests.txt"
grep -E "^(min_graph_size_1|while) \{" "$OUT/cells_tests.txt" | cut -c1-400
for K in ${CELLS:-1 2}; do
  for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
    f="$OUT/cells_k${K}${mode:+_while}.txt"
    echo "=== small row K=$K XLA_FLAGS='$mode'"
    JAXVMM_GRAPH_CELLS=$K XLA_FLAGS="$mode" timeout ${T_ROW:-90} python3 bench/train_step.py --models mlp --targets mlp_hidden \
      --mlp-shape 256,512,64 --variants save,jaxvmm --steps 30 --timeout 60 --out "$OUT/cells_k${K}${mode:+_while}.md" > "$f" 2>&1
    grep -E "^\| (mlp|model)|error|Error" "$f" | cut -c1-400 | head -4
  done
done
[[ "${T_XLA:-80}" == 0 ]] && exit 0
echo "=== gpu tests: tests/test_graph_xla.py (every command-buffer mode, K = 2)"
timeout ${T_XLA:-80} python3 -P -m pytest -v -rfs --tb=short --timeout=60 -p no:cacheprovider -m gpu tests/test_graph_xla.py \
  -k "not scan_of_32" > "$OUT/cells_xla.txt" 2>&1
echo "rc=$?"; show "$OUT/cells_xla.txt" 20
