#!/usr/bin/env bash
# The 1 MiB MLP-scan row under jax.profiler on the H200 (tools/round_profile.py): save on device and
# jaxvmm, default command buffers and +WHILE. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for v in save jaxvmm; do
  timeout 120 python3 tools/round_profile.py --variant $v --shape 256,512,64 --dir /tmp/prof_$v > "$OUT/prof_$v.txt" 2>&1
  echo "=== $v ($((SECONDS - T0)) s)"; grep -v "^WARNING\|^I0000\|^E0000" "$OUT/prof_$v.txt" | tail -28
done
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE timeout 120 python3 tools/round_profile.py --variant jaxvmm --shape 256,512,64 \
  --dir /tmp/prof_w > "$OUT/prof_jaxvmm_while.txt" 2>&1
echo "=== jaxvmm +WHILE ($((SECONDS - T0)) s)"; grep -v "^WARNING\|^I0000\|^E0000" "$OUT/prof_jaxvmm_while.txt" | tail -28
