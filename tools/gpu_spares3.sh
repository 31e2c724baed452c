#!/usr/bin/env bash
# Spare cells on one-cell call sites (large activations), H200, <= ~5 minutes: the graph-mode gpu tests
# with one cell and 2 spares per call site, then the MLP-scan MLP-hidden row (256 MiB per offload,
# 6 GiB per step) with 0 and 4 spares, save on device in the same run as each. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
JAXVMM_GRAPH_CELLS=1 JAXVMM_DEBUG_GRAPH_SPARES=2 gpu_tests graph_k1_spares2 80 tests/test_graph.py
: > "$OUT/rows.txt"
export STEPS=10 WARMUP=2 ROW_TIMEOUT=100
mlp_row spares=4 "" JAXVMM_DEBUG_GRAPH_SPARES=4
mlp_row spares=0 "" JAXVMM_DEBUG_GRAPH_SPARES=0
