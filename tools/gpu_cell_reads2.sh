#!/usr/bin/env bash
# One device call (nvidia-h200, ~4 min) after the review of reloads from offload cells (garm_ never waits
# for another stream; the request path clears the reload cell's grant on garm_): the graph and graph_xla
# gpu tests, the 1 MiB profile with the engine's counters, the offload suite with default command
# buffers. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 200 tests/test_graph.py tests/test_graph_xla.py
timeout 100 python3 tools/round_profile.py --variant jaxvmm --shape 256,512,64 --dir /tmp/prof_c > "$OUT/prof_cells.txt" 2>&1
echo "=== profile ($((SECONDS - T0)) s)"; grep -E "jaxvmm_take_reload|longest|engine:" "$OUT/prof_cells.txt" | head -6
gpu_tests offload 120 tests/test_offload.py
