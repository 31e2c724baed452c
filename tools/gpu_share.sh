#!/usr/bin/env bash
# Device call (2 GPUs; builds nothing: install jaxvmm first): the shared-slot tests (tests/test_share.py,
# gpu-marked and cpu ones) and bench/share_bw.py (GPU 0 exports, GPU 1 imports). Logs go to $OUT.
#   expect: every test passes (the two_gpus tests run: they skip only with fewer than 2 GPUs), the bench
#   table shows "imported" rows at x peer >= 0.8.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L 2>&1 | tee "$OUT/share_gpus.txt"
echo "=== tests/test_share.py (JAXVMM_REQUIRE_GPU=1 JAXVMM_REQUIRE_2GPU=1)"
JAXVMM_REQUIRE_GPU=1 JAXVMM_REQUIRE_2GPU=1 timeout 400 python3 -P -m pytest -q -rs -p no:cacheprovider tests/test_share.py \
  > "$OUT/share_tests.txt" 2>&1
echo "pytest exit $?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/share_tests.txt" | tail -20
echo "=== bench/share_bw.py"
timeout 150 python3 bench/share_bw.py --sizes 64M,256M,1G --iters 20 --markdown --out "$OUT/share_bw.md" \
  > "$OUT/share_bw.txt" 2>&1
echo "bench exit $?"
tail -25 "$OUT/share_bw.txt"
