#!/usr/bin/env bash
# The 1 MiB MLP-scan row under jax.profiler on the H200 (tools/round_profile.py): save on device and
# jaxvmm, default command buffers and +WHILE. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
for v in save jaxvmm; do round_prof "$v" "$v"; done
round_prof jaxvmm_while jaxvmm XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
