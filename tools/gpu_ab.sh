#!/usr/bin/env bash
# A/B on the H200: the 1 MiB row (and the 4 MiB row with spares) built from the commit before the engine
# split (ab_old/, an export of it) and from this tree, in one run. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
row() {  # row LABEL SHAPE [env...]
  local label=$1 shape=$2; shift 2
  env "$@" timeout 70 python3 bench/train_step.py --models mlp --targets mlp_hidden --mlp-shape $shape --variants save,jaxvmm \
    --steps 20 --warmup 3 --timeout 60 >> "$OUT/rows_$label.txt" 2>&1
  echo "=== $label $shape $* ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows_$label.txt" | tail -2 | cut -c1-200
}
(cd ab_old && python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_old.txt" 2>&1) || tail -5 "$OUT/build_old.txt"
row old 256,512,64
row old 256,512,64
row old 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_new.txt" 2>&1 || tail -5 "$OUT/build_new.txt"
row new 256,512,64
row new 256,512,64
row new 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64
