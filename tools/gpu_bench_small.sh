#!/usr/bin/env bash
# Device call: the small-activation rows of issue 8 (MLP-block scan, bf16, L=64, MLP hidden offloaded):
# save on device, JAX native offload and jaxvmm side by side, each in a fresh process.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -c "import jaxvmm" 2>/dev/null || python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1
for shape in ${SHAPES:-256,512,64 1024,512,64 256,1024,64}; do
  echo "=== B,D,L = $shape"
  timeout ${T:-170} python3 bench/train_step.py --models mlp --targets mlp_hidden --variants save,native,jaxvmm \
    --mlp-shape "$shape" --steps ${STEPS:-30} --warmup 3 --timeout 120 --out "$OUT/small_${shape//,/_}.md" 2>&1 | grep -E "^\|" 
done
