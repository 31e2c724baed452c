#!/usr/bin/env bash
# Session 34's third call: ticket lifetimes rewritten (holders read once ready, no drop while one is
# unread; collect() sweeps only what was issued before it; waits tolerate failed or donated arrays)
# and eager calls reusing their call site. Build; the lifetime tests on cuda:0; tools/eager_cost.py;
# then the gpu suites (offload, remat, rest, graph + graph_xla). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== built ($((SECONDS - T0)) s)"
JAXVMM_REQUIRE_GPU=1 gpu_tests lifetimes 150 tests/test_lifetimes.py
(cd /tmp && timeout 120 python3 "$OLDPWD/tools/eager_cost.py" > "$OUT/eager_cost.txt" 2>&1)
echo "=== eager_cost ($((SECONDS - T0)) s)"; cat "$OUT/eager_cost.txt" | tail -8
gpu_suites offload remat rest graph
exit 0
