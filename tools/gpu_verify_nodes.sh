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
timeout 120 python3 tools/round_profile.py --variant jaxvmm --shape 256,512,64 --dir /tmp/prof_n > "$OUT/prof_nodes.txt" 2>&1
echo "=== profile ($((SECONDS - T0)) s)"; grep -E "jaxvmm|longest|span" "$OUT/prof_nodes.txt" | head -12
capacity_trial dots26_reserved jaxvmm-dots 26 --warmup 3 --reserve-host 14G
