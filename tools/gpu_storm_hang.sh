#!/usr/bin/env bash
# Device call: the offload storm with bwd enqueued right behind fwd (as tests/test_engine.py does), under a
# watchdog that prints the engine counters and every thread's stack if it hangs.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
timeout 50 python3 tools/watchdog.py 25 tools/gpu_storm_idle.py storm --no-block 2>&1 | grep -v "site-packages" | cut -c1-1500 | tail -60
