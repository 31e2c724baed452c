#!/usr/bin/env bash
# The gpu suites at the current code, with JAXVMM_REQUIRE_GPU=1 and XLA's default flags: graph
# (tests/test_graph.py + tests/test_graph_xla.py, every command-buffer mode including CONCURRENT with
# unrolled loops), rest, offload and remat. tools/gpu_owed_more.sh is the follow-up call. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph rest offload remat
grep -E "^\.?(off|default|min_graph_size_1|while|while_unrolled|skip_temp|concurrent|while_concurrent|while_unrolled_concurrent) \{" "$OUT/graph.txt" | cut -c1-260
exit 0
