#!/usr/bin/env bash
# Early launches on by default: the gpu suites with the defaults (graph, offload, remat, rest), the
# 1-to-3-cells training REPS (5) times more under the watchdog with JAXVMM_GRAPH_PDL unset, then the
# 4 MiB and D=1024 rows (mlp_rows, N=3) while the call has time. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
unset JAXVMM_GRAPH_PDL
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph offload remat rest
(cd tests && python3 -c "import test_graph_xla as t; print(t.SCAN_K)") > /tmp/scan_k.py || exit 1
for i in $(seq "${REPS:-5}"); do
  XLA_FLAGS=--xla_gpu_autotune_level=0 JAXVMM_GRAPH_FUSED=0 timeout 60 python3 -P tools/watchdog.py 45 /tmp/scan_k.py > "$OUT/hang_$i.txt" 2>&1
  echo "=== run $i rc=$? bit-exact: $(grep -c '"losses_equal": true, "weights_equal": true' "$OUT/hang_$i.txt") ($((SECONDS - T0)) s)"
done
: > "$OUT/rows.txt"
(( SECONDS - T0 < 470 )) && ROW_TIMEOUT=30 mlp_rows "4MiB default" 1024,512,64 "${N:-3}"
(( SECONDS - T0 < 530 )) && ROW_TIMEOUT=30 mlp_rows "D=1024 default" 256,1024,64 "${N:-3}"
exit 0
