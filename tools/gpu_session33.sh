#!/usr/bin/env bash
# Session 33's first call: graph mode split into its parts (graph_cells, graph_offload, graph_reload):
# build, then the gpu suites (graph + graph_xla, offload, remat, rest) on the split. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== built ($((SECONDS - T0)) s)"
gpu_suites graph offload
(( SECONDS - T0 < 470 )) && gpu_suites remat
(( SECONDS - T0 < 500 )) && gpu_suites rest
exit 0
