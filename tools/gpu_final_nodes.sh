#!/usr/bin/env bash
# This session's last device call (nvidia-h200, ~5 min): what pinning host memory costs in device
# memory (tools/probe_reserve_cost.py; the 26-layer dots trial with --reserve-host 14G ran out of device
# memory), the offload gpu suite with default command buffers and with them off, and the small rows
# with separate-node rounds (the default now). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
timeout 120 python3 tools/probe_reserve_cost.py 1G 4G 14G > "$OUT/probe_reserve.txt" 2>&1
echo "=== probe ($((SECONDS - T0)) s)"; grep -E "engine|reserve_host|Error" "$OUT/probe_reserve.txt"
gpu_tests offload 150 tests/test_offload.py tests/test_engine.py tests/test_dropin.py
XLA_FLAGS=--xla_gpu_enable_command_buffer= gpu_tests offload_off 120 tests/test_offload.py
: > "$OUT/rows.txt"
mlp_row nodes 256,512,64
mlp_row nodes 256,512,64
mlp_row nodes_w 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
mlp_row nodes 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_DEBUG_GRAPH_SPARES=64
