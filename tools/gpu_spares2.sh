#!/usr/bin/env bash
# Spare cells, second call: lends only while more graph D2Hs are queued than the channel has cells. The
# 4 MiB and 1 MiB rows with graph_cells 2 / 4 and 0 / 64 spares, then the graph-mode gpu tests with 8
# spares. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
: > "$OUT/rows.txt"
export ROW_TIMEOUT=60
mlp_row cells=2,spares=64 1024,512,64 JAXVMM_GRAPH_CELLS=2 JAXVMM_GRAPH_SPARES=64 XLA_FLAGS=""
mlp_row cells=4,spares=64 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64 XLA_FLAGS=""
mlp_row cells=4,spares=0 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=0 XLA_FLAGS=""
mlp_row cells=2,spares=64 256,512,64 JAXVMM_GRAPH_CELLS=2 JAXVMM_GRAPH_SPARES=64 XLA_FLAGS=""
mlp_row cells=4,spares=64 256,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64 XLA_FLAGS=""
mlp_row cells=4,spares=64 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=64 XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE"
JAXVMM_GRAPH_SPARES=8 gpu_tests graph_spares8 150 tests/test_graph.py tests/test_graph_xla.py
