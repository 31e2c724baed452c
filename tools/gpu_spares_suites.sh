#!/usr/bin/env bash
# Held cells and kept spares under real workloads: with JAXVMM_DEBUG_GRAPH_SPARES (default 2; few, so that
# they run out and cells are held) and JAXVMM_REQUIRE_GPU=1, the graph-mode gpu tests (graph +
# graph_xla), then the offload and remat suites with +WHILE (every scan one graph). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1 JAXVMM_DEBUG_GRAPH_SPARES=${JAXVMM_DEBUG_GRAPH_SPARES:-2}
gpu_tests graph_spares 220 tests/test_graph.py tests/test_graph_xla.py
W=--xla_gpu_enable_command_buffer=+WHILE
XLA_FLAGS=$W gpu_tests offload_while_spares 150 tests/test_offload.py
XLA_FLAGS=$W timeout 200 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/remat_while_spares.txt" 2>&1
echo "=== remat_while_spares rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/remat_while_spares.txt" | tail -1) ($((SECONDS - T0)) s)"
grep -E "^(FAILED|ERROR)" "$OUT/remat_while_spares.txt" | cut -c1-250 | head -6
