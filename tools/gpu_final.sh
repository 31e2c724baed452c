#!/usr/bin/env bash
# A short closing device call (~5 minutes): build; the small-activation row (1 MiB per offload) with
# fused rounds and two-node rounds in the default XLA mode; a capacity trial of jaxvmm (names) at
# ${CAP_N:-27} layers under the 24 GiB budget (watchdog: native stacks if it hangs); the graph-mode gpu
# tests; the +WHILE row; the K = 1..3 XLA test in the time left. Logs under $OUT (at most 8 files).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
row() {  # row FUSED XLA_FLAGS name
  JAXVMM_GRAPH_FUSED=$1 XLA_FLAGS="$2" timeout ${T_ROW:-50} python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --mlp-shape 256,512,64 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 45 >> "$OUT/rows.txt" 2>&1
  echo "=== row fused=$1 XLA_FLAGS='$2'"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-330
}
: > "$OUT/rows.txt"
row 1 ""
row 0 ""
echo "=== capacity trial jaxvmm-hidden n=${CAP_N:-27}"
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${T_CAP:-80} python3 -P tools/watchdog.py $(( ${T_CAP:-80} - 12 )) bench/capacity.py \
  --trial jaxvmm-hidden ${CAP_N:-27} --budget 24G > "$OUT/capacity.txt" 2>&1
grep -E "CAPACITY_RESULT|watchdog|Error" "$OUT/capacity.txt" | cut -c1-900
grep -B3 -A8 "_ZN6jaxvmm6Engine" "$OUT/capacity.txt" | grep -v "python3\|libpython" | cut -c1-200 | head -40
echo "=== gpu tests: tests/test_graph.py (fused and two-node)"
timeout ${T_TESTS:-90} python3 -P -m pytest -q -rfs --tb=short --timeout=80 -p no:cacheprovider -m gpu tests/test_graph.py > "$OUT/tests.txt" 2>&1
echo "rc=$?"; grep -E "FAILED|ERROR|passed|failed|Timeout|^E " "$OUT/tests.txt" | cut -c1-240 | tail -20
row 1 "--xla_gpu_enable_command_buffer=+WHILE"
echo "=== gpu test: K = 1..3 cells under XLA, fused and two-node, default and +WHILE"
timeout ${T_XLA:-150} python3 -P -m pytest -q -rfs --tb=short --timeout=140 -p no:cacheprovider -m gpu -s \
  tests/test_graph_xla.py::test_rounds_of_one_to_three_cells_are_bit_exact > "$OUT/xla.txt" 2>&1
echo "rc=$?"; grep -E "FAILED|ERROR|passed|failed|Timeout|^E |fused K|two-node K" "$OUT/xla.txt" | cut -c1-240 | tail -20
