#!/usr/bin/env bash
# The engine split (ledger / transfers / op ring / graph mode) on the H200: the graph-mode and ring-path
# gpu tests, the offload suite with command buffers off, the spare-cell XLA test's new workload, where a
# ring-path handler's host time goes (tools/ring_cost.py under JAXVMM_DEBUG_TRACE), then the 1 MiB row with
# the grant kernels as they are and without the trailing system fence of a round's publish. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
gpu_tests graph 240 tests/test_graph.py tests/test_graph_xla.py
gpu_tests ring 150 tests/test_offload.py tests/test_engine.py tests/test_dropin.py
XLA_FLAGS=--xla_gpu_enable_command_buffer= gpu_tests offload_off 100 tests/test_offload.py
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 60 python3 tools/ring_cost.py > "$OUT/ring_cost.txt" 2>&1
XLA_FLAGS=--xla_gpu_enable_command_buffer= JAXVMM_DEBUG_TRACE=1 timeout 60 python3 tools/ring_cost.py > "$OUT/ring_cost_traced.txt" 2> "$OUT/trace.txt"
python3 tools/ring_cost.py --trace "$OUT/trace.txt" >> "$OUT/ring_cost_traced.txt"; rm -f "$OUT/trace.txt"
echo "=== ring cost ($((SECONDS - T0)) s)"; cat "$OUT/ring_cost.txt" | tail -2; head -22 "$OUT/ring_cost_traced.txt"
: > "$OUT/rows.txt"
mlp_row fenced 256,512,64
python3 - <<'PY'
import re
p = "ffi/kernels/graph_kernels.cu"; s = open(p).read()
old = "      *(volatile u64*)*(volatile u64*)&c->publish = 1;\n      __threadfence_system();\n"
assert old in s
open(p, "w").write(s.replace(old, "      *(volatile u64*)*(volatile u64*)&c->publish = 1;\n"))
PY
bash tools/gen_ptx.sh && python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build2.txt" 2>&1 || tail -5 "$OUT/build2.txt"
mlp_row no_trailing_fence 256,512,64
mlp_row no_trailing_fence_2 256,512,64
