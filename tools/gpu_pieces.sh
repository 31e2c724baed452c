#!/usr/bin/env bash
# One device call (~3 min): what each step of a graph-mode round costs (tools/micro/round_pieces.py,
# no jaxvmm), then the spare-cell XLA test on its larger workload. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
timeout 120 python3 tools/micro/round_pieces.py > "$OUT/pieces.txt" 2>&1; cat "$OUT/pieces.txt" | tail -30
gpu_tests spares 200 tests/test_graph_xla.py -k spare_cells
grep -E "^(default|while) " "$OUT/spares.txt"
