#!/usr/bin/env bash
# Where an op-ring handler's host time goes: tools/ring_cost.py with JAXVMM_DEBUG_RING_PROFILE=1 (each part of
# an offload / reload handler, medians) N times (default 2), with JAXVMM_DEBUG_WORKER_SPIN_US=0 once, and a
# traced driver-call breakdown. Command buffers off. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
for i in $(seq "${N:-2}") s0; do
  spin=50; [[ $i == s0 ]] && spin=0
  XLA_FLAGS=$OFF JAXVMM_DEBUG_RING_PROFILE=1 JAXVMM_DEBUG_WORKER_SPIN_US=$spin timeout 90 python3 tools/ring_cost.py > "$OUT/prof_$i.txt" 2>&1
  echo "=== ring_cost profile $i (spin $spin us) ($((SECONDS - T0)) s)"; tail -3 "$OUT/prof_$i.txt"
done
ring_breakdown 30
