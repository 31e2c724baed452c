#!/usr/bin/env bash
# Device call (issue 11 items 4, 5): build, the host-store and copy-piece gpu tests, then offload bandwidth
# for both host stores side by side (offload, reload, both at once with and without 64 MiB pieces, cold
# 1 GiB offload per store). About 3-4 minutes on one H200.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
echo "=== gpu tests (host store, pieces, staging pools)"
JAXVMM_REQUIRE_GPU=1 timeout 150 python3 -P -m pytest -q -p no:cacheprovider tests/test_host_store.py 2>&1 \
  | grep -E "^(FAILED|ERROR)|passed|failed|Error" | tail -8
echo "=== offload_bw"
timeout 300 python3 bench/offload_bw.py --sizes 256M,1G --host-store pinned,host_numa --markdown --out "$OUT/bw.md" 2>&1 \
  | grep -E "^\||UNAVAILABLE|failed|DIFFERS|engine at the end" | head -60
