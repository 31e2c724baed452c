#!/usr/bin/env bash
# One device call (~2 min): where the 1 MiB row's step time goes beyond the rounds' own kernels:
# tools/round_profile.py for save on device and jaxvmm (separate-node and fused rounds; default
# command buffers, and +WHILE), with kernel percentiles and the compute stream's idle gaps. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
prof() {  # prof LABEL VARIANT [VAR=value...]
  local label=$1 v=$2; shift 2
  env "$@" timeout 120 python3 tools/round_profile.py --variant $v --shape 256,512,64 --dir /tmp/prof_$label > "$OUT/prof_$label.txt" 2>&1
  echo "=== $label $* ($((SECONDS - T0)) s)"; grep -v "^WARNING\|^I0000\|^E0000" "$OUT/prof_$label.txt" | grep -E "jaxvmm|span|compute stream|^    " | head -14
}
prof save save
prof nodes jaxvmm JAXVMM_GRAPH_FUSED=0
prof fused jaxvmm JAXVMM_GRAPH_FUSED=1
prof save_w save XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
prof nodes_w jaxvmm JAXVMM_GRAPH_FUSED=0 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
