#!/usr/bin/env bash
# The grant kernels with scoped acquire/release (no full fences on the fast path) on the H200: the
# graph-mode gpu tests (six XLA modes), the round kernels' durations under jax.profiler (1 MiB row),
# then the 1 MiB row twice and the 4 MiB row with spares. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 240 tests/test_graph.py tests/test_graph_xla.py
round_prof k jaxvmm
: > "$OUT/rows.txt"
mlp_row acq_rel 256,512,64
mlp_row acq_rel 256,512,64
mlp_row acq_rel 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
mlp_row acq_rel 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
