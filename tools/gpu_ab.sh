#!/usr/bin/env bash
# A/B on the H200: the 1 MiB row (and the 4 MiB row with spares) built from another commit (ab_old/, an
# export of it: git archive REV | tar -x -C ab_old) and from this tree, in one run. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"  # builds and installs this tree
ab_rows() {  # ab_rows LABEL
  mlp_row "$1" 256,512,64
  mlp_row "$1" 256,512,64
  mlp_row "$1" 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
}
: > "$OUT/rows.txt"
(cd ab_old && python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_old.txt" 2>&1) || tail -5 "$OUT/build_old.txt"
ab_rows old
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_new.txt" 2>&1 || tail -5 "$OUT/build_new.txt"
ab_rows new
