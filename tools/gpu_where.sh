#!/usr/bin/env bash
# One device call (~2 min): where the 1 MiB row's step time goes beyond the rounds' own kernels:
# tools/round_profile.py for save on device and jaxvmm (separate-node and fused rounds; default
# command buffers, and +WHILE), with kernel percentiles and the compute stream's idle gaps. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
round_prof save save
round_prof nodes jaxvmm JAXVMM_GRAPH_FUSED=0
round_prof fused jaxvmm JAXVMM_GRAPH_FUSED=1
round_prof save_w save XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
round_prof nodes_w jaxvmm JAXVMM_GRAPH_FUSED=0 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
