#!/usr/bin/env bash
# Spare cells (graph_spares) on the H200, one call (~9 minutes): the graph-mode gpu tests with 8 spares
# per offload call site; then the small-activation rows (4 MiB and 1 MiB per offload) with 0 / 16 / 32
# spares, default XLA flags and +WHILE, save on device in the same run as each jaxvmm row. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
JAXVMM_DEBUG_GRAPH_SPARES=8 gpu_tests graph_spares8 150 tests/test_graph.py tests/test_graph_xla.py
: > "$OUT/rows.txt"
export ROW_TIMEOUT=60
mlp_row spares=0 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=0 XLA_FLAGS=""
mlp_row spares=32 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=32 XLA_FLAGS=""
mlp_row spares=16 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=16 XLA_FLAGS=""
mlp_row spares=0 256,512,64 JAXVMM_DEBUG_GRAPH_SPARES=0 XLA_FLAGS=""
mlp_row spares=16 256,512,64 JAXVMM_DEBUG_GRAPH_SPARES=16 XLA_FLAGS=""
mlp_row spares=32 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=32 XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE"
mlp_row spares=0 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=0 XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE"
(( SECONDS - T0 < 480 )) && mlp_row spares=64 1024,512,64 JAXVMM_DEBUG_GRAPH_SPARES=64 XLA_FLAGS=""
(( SECONDS - T0 < 520 )) && mlp_row spares=16 256,1024,64 JAXVMM_DEBUG_GRAPH_SPARES=16 XLA_FLAGS=""
