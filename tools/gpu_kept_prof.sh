#!/usr/bin/env bash
# Where the 4 MiB row's step goes with spares: tools/round_profile.py (one traced step, a timeline of
# each stream) for save on device and jaxvmm with 2 cells and SPARES (default "0 32") spares. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
prof4() {
  local label=$1 v=$2; shift 2
  env "$@" timeout 120 python3 tools/round_profile.py --variant "$v" --shape 1024,512,64 --steps 1 --bin-us ${BIN:-100} \
    --dir "/tmp/prof_$label" > "$OUT/prof_$label.txt" 2>&1
  echo "=== profile $label $v $* ($((SECONDS - T0)) s)"; grep -v "^\s*$" "$OUT/prof_$label.txt" | grep -v "longest" | tail -40 | cut -c1-260
}
prof4 save save
for n in ${SPARES:-0 32}; do prof4 "s$n" jaxvmm JAXVMM_GRAPH_CELLS=2 JAXVMM_DEBUG_GRAPH_SPARES=$n; done
