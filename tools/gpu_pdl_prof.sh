#!/usr/bin/env bash
# Where the 1 MiB row's remaining time goes with early-launched rounds: tools/round_profile.py for save
# on device and for jaxvmm (JAXVMM_GRAPH_PDL on, the default), sharing one XLA autotune cache. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
AT="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/jaxvmm_autotune"
for v in save jaxvmm; do
  XLA_FLAGS="$AT" timeout 120 python3 tools/round_profile.py --variant "$v" --shape 256,512,64 --dir "/tmp/prof_$v" > "$OUT/prof_$v.txt" 2>&1
  echo "=== profile $v ($((SECONDS - T0)) s)"; grep -v "^    |" "$OUT/prof_$v.txt" | head -50
done
exit 0
