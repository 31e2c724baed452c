#!/usr/bin/env bash
# One device call (nvidia-h200, ~7 min) after separate-node rounds became the default: the engine, graph
# and graph_xla gpu tests; the offload suite with command buffers off and with +WHILE; the profile of the
# 1 MiB row (which rounds wait: the longest of each kernel); the jaxvmm (dots) capacity trial at 26
# layers with a step's worth of host memory pinned first (reserve_host; never run on a GPU before).
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests core 230 tests/test_engine.py tests/test_graph.py tests/test_graph_xla.py
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE gpu_tests offload_while 120 tests/test_offload.py
round_prof nodes jaxvmm
capacity_trial dots26_reserved jaxvmm-dots 26 --warmup 3 --reserve-host 14G
