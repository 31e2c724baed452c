#!/usr/bin/env bash
# The closing call after the held-cell review: with JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests in
# default config and with 2 spares, the other gpu files, the offload and remat suites (XLA's default
# command buffers), then the 4 MiB row with 2 cells and 32 spares and the 1 MiB row. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
JAXVMM_DEBUG_GRAPH_SPARES=2 gpu_tests graph_spares 200 tests/test_graph.py tests/test_graph_xla.py
gpu_tests rest 150 $REST_TESTS
gpu_tests offload 120 tests/test_offload.py
timeout 120 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/remat.txt" 2>&1
echo "=== remat rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/remat.txt" | tail -1) ($((SECONDS - T0)) s)"
grep -E "^(FAILED|ERROR)" "$OUT/remat.txt" | cut -c1-250 | head -6
(( SECONDS - T0 < 470 )) && spare_rows "2:32:1024,512,64 2:0:256,512,64"
exit 0
