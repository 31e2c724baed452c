#!/usr/bin/env bash
# Graph mode reads another call site's offload cell only where XLA keeps the recorded order (the
# engine reads XLA_FLAGS): tests/test_graph_xla.py's pipelined scan in every command-buffer mode and the
# training test in the default, +WHILE and CONCURRENT modes (JAXVMM_REQUIRE_GPU=1, with each mode's
# stats). tools/gpu_while_concurrent.sh is the loop that found the hang of the first fix. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
JAXVMM_REQUIRE_GPU=1 gpu_tests xla_order 300 -s tests/test_graph_xla.py \
  -k "pipelined or (bit_exact_in_every and (default or concurrent or while))"
grep -E "^\.?(off|default|min_graph_size_1|while|while_unrolled|skip_temp|concurrent|while_concurrent) \{'graph_captures'" "$OUT/xla_order.txt" | cut -c1-200
exit 0
