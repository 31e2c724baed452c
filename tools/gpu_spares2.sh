#!/usr/bin/env bash
# Spare cells, second call: lends only while more graph D2Hs are queued than the channel has cells. The
# 4 MiB and 1 MiB rows with graph_cells 2 / 4 and 0 / 64 spares, then the graph-mode gpu tests with 8
# spares. Logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
spare_rows "2:64:1024,512,64 4:64:1024,512,64 4:0:1024,512,64 2:64:256,512,64 4:64:256,512,64 4:64:1024,512,64:while"
JAXVMM_DEBUG_GRAPH_SPARES=8 gpu_tests graph_spares8 150 tests/test_graph.py tests/test_graph_xla.py
