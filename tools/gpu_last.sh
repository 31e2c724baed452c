#!/usr/bin/env bash
# Device call: build, the gpu-marked suite, one small-activation row, offload bandwidth at 64 MiB and 4 GiB.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== gpu tests"
JAXVMM_REQUIRE_GPU=1 timeout 140 python3 -P -m pytest -q -m gpu tests 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
echo "=== small row"
timeout 80 python3 bench/train_step.py --models mlp --targets mlp_hidden --variants save,jaxvmm --mlp-shape 256,512,64 \
  --steps 30 --warmup 3 --timeout 70 --out "$OUT/small.md" 2>&1 | grep -E "^\| mlp"
echo "=== offload_bw"
timeout 120 python3 bench/offload_bw.py --sizes 64M,4G --iters 10 --markdown 2>&1 | grep -E "^\| (64|4)"
