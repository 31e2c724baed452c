#!/usr/bin/env bash
# What a graph-mode round's kernel time is made of (1 MiB row, jax.profiler): rounds as two nodes (the
# take kernel, which includes any wait for the poller's grant, and the copy kernel), and fused rounds
# with 4 cells per call site; then the 1 MiB row with 4 cells. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
round_prof two_nodes jaxvmm JAXVMM_GRAPH_FUSED=0
round_prof cells4 jaxvmm JAXVMM_GRAPH_CELLS=4
mlp_row cells4 256,512,64 JAXVMM_GRAPH_CELLS=4
