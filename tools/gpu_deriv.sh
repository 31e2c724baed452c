#!/usr/bin/env bash
# Device call for the `deriv` branch (issue 9: a VJP function called several times, second derivatives
# from outside a staged first derivative): build, the drop-in file's gpu-marked twins on cuda:0, then
# test_dropin/test_semantics/test_remat with cuda:0 as the default device. Logs in $OUT. ~6 min.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
echo "=== drop-in (gpu twins)"
JAXVMM_REQUIRE_GPU=1 timeout 150 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/test_dropin.py -rf \
  > "$OUT/dropin_gpu.txt" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/dropin_gpu.txt" | tail -14
echo "=== drop-in, semantics, remat (default device: cuda:0)"
timeout 330 python3 -P -m pytest -q -p no:cacheprovider tests/test_dropin.py tests/test_semantics.py tests/test_remat.py -rf \
  > "$OUT/deriv_all.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/deriv_all.txt" | tail -20
