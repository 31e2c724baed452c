#!/usr/bin/env bash
# Device call for issue 9 item 6 (jaxvmm.checkpoint as a drop-in for jax.checkpoint): build, then the
# drop-in suite on cuda:0 (gpu-marked twins) and the remat/semantics/flax files in full, logs in $OUT.
# Fits one device call (at most ~9.5 min: build ~1, twins <= 2, the four files <= 6.7).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
echo "=== drop-in (gpu twins)"
JAXVMM_REQUIRE_GPU=1 timeout 120 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/test_dropin.py \
  > "$OUT/dropin_gpu.txt" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dropin_gpu.txt" | tail -12
echo "=== drop-in, remat, semantics, flax (default device: cuda:0)"
timeout 400 python3 -P -m pytest -q -p no:cacheprovider tests/test_dropin.py tests/test_remat.py tests/test_semantics.py \
  tests/test_flax.py > "$OUT/remat_all.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/remat_all.txt" | tail -20
