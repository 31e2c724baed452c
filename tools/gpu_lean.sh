#!/usr/bin/env bash
# One device call (nvidia-h200, ~8 min): the leaner fused round kernels (one-atomic offload take, `ready`
# carrying the cell, the offload's source loads issued before the take) against the commit before them
# (ab_old/: git archive HEAD | tar -x -C ab_old), in one run: bench/graph_rounds.py (rounds alone) and
# the 1 MiB and 4 MiB rows; then the graph-mode gpu tests on the new kernels. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"  # builds and installs this tree
export JAXVMM_REQUIRE_GPU=1
side() {  # side LABEL
  timeout 60 python3 bench/graph_rounds.py --reps 40 > "$OUT/rounds_$1.txt" 2>&1
  echo "=== rounds $1 ($((SECONDS - T0)) s)"; grep -E "^\|" "$OUT/rounds_$1.txt" | tail -2
  timeout 60 python3 bench/graph_rounds.py --size 4M --reps 40 > "$OUT/rounds4_$1.txt" 2>&1
  grep -E "^\|" "$OUT/rounds4_$1.txt" | tail -2
  mlp_row "$1" 256,512,64
  mlp_row "$1" 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
}
: > "$OUT/rows.txt"
side new
(cd ab_old && python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_old.txt" 2>&1) || tail -5 "$OUT/build_old.txt"
side old
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_new.txt" 2>&1 || tail -5 "$OUT/build_new.txt"
mlp_row new2 256,512,64
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
