#!/usr/bin/env bash
# The first device call of the next session (nvidia-h200, <= ~8 minutes), checking on the H200 what
# this session changed after its last GPU run: the grant kernels' volatile cell-address load (PTX), the
# spare-cell fixes (a failed grant after a lend; a waiting round's own free spares), and the new gpu test
# of spare cells under XLA (test_graph_xla covers six command-buffer modes; the offload suite runs with
# command buffers off and +WHILE too); then the jaxvmm (dots) capacity trial at 26 layers, whose result now records
# the engine's graph counters (last session: 2.23x of remat there, unexplained). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
JAXVMM_DEBUG_GRAPH_SPARES=8 gpu_tests graph_spares8 120 tests/test_graph.py
XLA_FLAGS=--xla_gpu_enable_command_buffer= gpu_tests offload_off 100 tests/test_offload.py
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE gpu_tests offload_while 100 tests/test_offload.py
capacity_trial dots26 jaxvmm-dots 26 --warmup 1
