#!/usr/bin/env bash
# Device call: build, the small-activation rows, the large MLP rows, then the gpu-marked suite.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
T=80 STEPS=30 bash tools/gpu_bench_small.sh
echo "=== large rows"
timeout 190 python3 bench/train_step.py --models mlp --targets block_input,mlp_hidden --variants save,native,jaxvmm \
  --steps 8 --timeout 100 --out "$OUT/large.md" 2>&1 | grep -E "^\|"
echo "=== gpu tests"
JAXVMM_REQUIRE_GPU=1 timeout 150 python3 -P -m pytest -q -m gpu -x tests 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
