#!/usr/bin/env bash
# The 1 MiB MLP-hidden row with early launches off and on (JAXVMM_GRAPH_PDL), in XLA's default mode and
# with +WHILE: N (5) alternating processes of save on device and jaxvmm each (mlp_rows: one shared XLA
# autotune cache), medians and per-run ratios. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
for mode in default while; do
  flags=""; [[ $mode == while ]] && flags="--xla_gpu_enable_command_buffer=+WHILE"
  for pdl in 0 1; do ROW_TIMEOUT=40 mlp_rows "1MiB $mode pdl=$pdl" 256,512,64 "${N:-5}" JAXVMM_GRAPH_PDL=$pdl XLA_FLAGS="$flags"; done
done
exit 0
