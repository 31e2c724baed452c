#!/usr/bin/env bash
# GraphRecorder split (no behaviour change): the graph, offload, remat and rest gpu suites
# (JAXVMM_REQUIRE_GPU=1); tools/step_counters.py on the 1 MiB row (which round of a step waits for the
# poller); then capacity trials that narrow the brackets left open (save on device between 13 and 17
# layers, full remat at 27 timed in this run). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph offload remat rest
timeout 90 python3 tools/step_counters.py --steps 6 --watch > "$OUT/step_counters.txt" 2>&1
echo "=== step_counters ($((SECONDS - T0)) s)"; tail -30 "$OUT/step_counters.txt" | cut -c1-400
capacity_trial save15 save 15
if grep -q '"status": "fit"' "$OUT/trial_save15.txt"; then capacity_trial save16 save 16; else capacity_trial save14 save 14; fi
capacity_trial remat27 remat 27
exit 0
