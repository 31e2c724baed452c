#!/usr/bin/env bash
# Session 32's first call: the early-launch hang check (tools/gpu_pdl_hang.sh: REPS runs of the
# 1-to-3-cells training with JAXVMM_GRAPH_PDL=1 under the watchdog, then the graph-mode gpu suite with
# early launches on), then the offload and remat gpu suites with the defaults (early launches off) while
# the call has time left. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
REPS=${REPS:-3} bash "$(dirname "$0")/gpu_pdl_hang.sh"
export SKIP_BUILD=1
source "$(dirname "$0")/gpu_prelude.sh"
(( SECONDS - T0 < 440 )) && gpu_suites offload
(( SECONDS - T0 < 510 )) && gpu_suites remat
exit 0
