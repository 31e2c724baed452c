#!/usr/bin/env bash
# Device call: tools/probe_reload_race.py under variants (cells, prediction, fused, fault, order, size).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
v() { echo "=== $*"; local e=$1; shift; shift; env $e timeout 40 python3 -P tools/probe_reload_race.py "$@" 2>&1 | tail -6 | cut -c1-300; }
v A=default -- --fault
v A=nofault -- 
v JAXVMM_GRAPH_CELLS=1 -- --fault
v JAXVMM_DEBUG_PREDICT=0 -- --fault
v A=forward -- --fault --forward
v JAXVMM_GRAPH_FUSED=0 -- --fault
v A=small -- --fault --n 1M --rounds 300
