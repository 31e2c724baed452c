#!/usr/bin/env bash
# Follow-up to tools/gpu_owed_suites.sh on the still-warm machine (SKIP_BUILD=1 keeps its build): the
# ring path (command buffers off), tests/test_graph.py under +WHILE command buffers, and the 1 MiB
# MLP-hidden row (save on device vs jaxvmm) ROWS times (2). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ring_tests
JAXVMM_REQUIRE_GPU=1 XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE" gpu_tests graph_while 200 tests/test_graph.py
: > "$OUT/rows.txt"
for i in $(seq ${ROWS:-2}); do ROW_TIMEOUT=50 mlp_row "1MiB#$i" 256,512,64; done
exit 0
