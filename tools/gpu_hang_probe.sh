#!/usr/bin/env bash
# One test's script run directly under tools/watchdog.py (engine stats, Python and native stacks on a
# hang): test_graph_xla.py's SCAN_K (rounds of 1, 2, 3 cells) in default mode with three-node rounds,
# REPS times (default 2). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
(cd tests && python3 -c "import test_graph_xla as t; print(t.SCAN_K)") > /tmp/scan_k.py || exit 1
for i in $(seq "${REPS:-2}"); do
  XLA_FLAGS=--xla_gpu_autotune_level=0 JAXVMM_GRAPH_FUSED=0 timeout 170 python3 -P tools/watchdog.py 140 /tmp/scan_k.py \
    > "$OUT/hang_$i.txt" 2>&1
  echo "=== run $i rc=$? ($((SECONDS - T0)) s)"; grep -E "RESULT|watchdog" "$OUT/hang_$i.txt" | cut -c1-300 | head -5
done
