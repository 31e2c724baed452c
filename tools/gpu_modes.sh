#!/usr/bin/env bash
# The offload and remat suites on the H200 in three XLA command-buffer modes: off
# (--xla_gpu_enable_command_buffer=), default, and +WHILE. Offload: its gpu-marked tests (cpu and cuda
# twins); remat: the whole file with cuda:0 as jax's default device. Logs under $OUT (7 files).
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for mode in off default while; do
  case $mode in
    off) flags="--xla_gpu_enable_command_buffer=" ;;
    default) flags="" ;;
    while) flags="--xla_gpu_enable_command_buffer=+WHILE" ;;
  esac
  XLA_FLAGS="$flags" gpu_tests offload_$mode 150 tests/test_offload.py
  XLA_FLAGS="$flags" timeout 150 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/remat_$mode.txt" 2>&1
  echo "=== remat_$mode rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/remat_$mode.txt" | tail -1) ($((SECONDS - T0)) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/remat_$mode.txt" | cut -c1-250 | head -6
done
