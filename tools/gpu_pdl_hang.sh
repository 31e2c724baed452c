#!/usr/bin/env bash
# The hang seen once with early launches (JAXVMM_GRAPH_PDL=1): test_graph_xla.py's 1-to-3-cells
# training (SCAN_K) in XLA's default mode with three-node rounds launched early, REPS times (default 4)
# under tools/watchdog.py (stats, Python and native stacks on a hang); then the graph-mode gpu suite
# with JAXVMM_GRAPH_PDL=1 in the environment (JAXVMM_REQUIRE_GPU=1; test_graph_xla.py's scripts run
# under the watchdog too). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
(cd tests && python3 -c "import test_graph_xla as t; print(t.SCAN_K)") > /tmp/scan_k.py || exit 1
for i in $(seq "${REPS:-4}"); do
  XLA_FLAGS=--xla_gpu_autotune_level=0 JAXVMM_GRAPH_FUSED=0 JAXVMM_GRAPH_PDL=1 timeout 170 \
    python3 -P tools/watchdog.py 140 /tmp/scan_k.py > "$OUT/hang_$i.txt" 2>&1
  echo "=== run $i rc=$? ($((SECONDS - T0)) s)"; grep -E "RESULT|watchdog" "$OUT/hang_$i.txt" | cut -c1-300 | head -5
done
JAXVMM_GRAPH_PDL=1 gpu_suites graph
exit 0
