#!/usr/bin/env bash
# Spares that keep their bytes after the D2H, and cells held when every spare is lent: the small-
# activation rows in ROWS (spare_rows specs; default: 4 MiB with 2 cells and 0/8/16/32/64 spares, 1 MiB
# with 16; the second call of that session ran ROWS="2:16:1024,512,64 2:24:1024,512,64
# 2:32:1024,512,64 4:32:1024,512,64 2:32:1024,512,64:while 2:0:256,512,64 2:16:256,512,64" TESTS=0),
# then (TESTS=1, default) the graph-mode gpu tests with TEST_SPARES (2) spares and the ring-path tests.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
spare_rows "${ROWS:-2:0:1024,512,64 2:8:1024,512,64 2:16:1024,512,64 2:32:1024,512,64 2:64:1024,512,64 2:16:256,512,64}"
[[ ${TESTS:-1} == 1 ]] || exit 0
JAXVMM_DEBUG_GRAPH_SPARES=${TEST_SPARES:-2} gpu_tests graph_spares 200 tests/test_graph.py tests/test_graph_xla.py
ring_tests
