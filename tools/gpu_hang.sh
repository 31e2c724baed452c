#!/usr/bin/env bash
# Device call (one H200): the storm hang's causes told apart, with and without jaxvmm's module-load barrier
# (tools/gpu_hang_diag.py; ~5 min worst case), then the storm test itself.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
DIAG_LIMIT=40 timeout 420 python3 tools/gpu_hang_diag.py 2>&1 | grep -v "^  warnings.warn\|site-packages/jax" | cut -c1-600 | tail -220
timeout 130 python3 -m pytest -q -p no:cacheprovider -x "tests/test_engine.py::test_gpu_offload_storm_stays_within_depth_cells" \
  "tests/test_graph.py::test_grant_kernels_are_warmed_at_the_first_initialize_and_a_failed_warm_up_falls_back" 2>&1 | tail -15
