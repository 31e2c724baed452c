#!/usr/bin/env bash
# Spares that keep their bytes after the D2H (reloads read them device to device until a lend reuses
# the spare) and cells held when every spare is lent: the 4 MiB row with 2 cells and SPARES spares
# (0 8 16 32 64), the 1 MiB row with 16, then (TESTS=1) the graph-mode gpu tests with TEST_SPARES (2)
# spares and the ring-path tests. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
: > "$OUT/rows.txt"
export ROW_TIMEOUT=60
for n in ${SPARES:-0 8 16 32 64}; do
  mlp_row cells=2,spares=$n 1024,512,64 JAXVMM_GRAPH_CELLS=2 JAXVMM_GRAPH_SPARES=$n XLA_FLAGS=""
done
mlp_row cells=2,spares=16 256,512,64 JAXVMM_GRAPH_SPARES=16 XLA_FLAGS=""
[[ ${TESTS:-1} == 1 ]] || exit 0
JAXVMM_GRAPH_SPARES=${TEST_SPARES:-2} gpu_tests graph_spares 200 tests/test_graph.py tests/test_graph_xla.py
ring_tests
