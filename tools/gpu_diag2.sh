#!/usr/bin/env bash
# Device call: the storm and idle-engine diagnostics under a watchdog, then the peak-depth test.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
for w in storm idle; do
  echo "=== $w"; timeout 60 python3 tools/watchdog.py 40 tools/gpu_storm_idle.py $w 2>&1 | cut -c1-900 | grep -v "^  File.*site-packages" | tail -40
done
echo "=== peak test"
timeout 90 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider "tests/test_offload.py::test_peak_mapped_bytes_bounded_by_prefetch_depth[cuda-1]" 2>&1 | grep -E "^E |passed|failed|Error" | cut -c1-600 | tail -15
