#!/usr/bin/env bash
# The training script of tests/test_graph_xla.py under +WHILE and CONCURRENT scheduling, RUNS times
# (3) under tools/watchdog.py (WD seconds, 90: engine stats and every thread's stack if it hangs; only
# the logs of failed runs are kept under $OUT). This loop caught the poller hanging in a revoke kernel's
# wait while a round waited for it (a first fix of CONCURRENT scheduling, not kept). Unless ONLY_TRAIN
# is set, then the pipelined-scan test in every mode and the ring-path gpu tests (command buffers off).
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
python3 -P -c "import sys; sys.path.insert(0, 'tests'); import test_graph_xla as T; open('/tmp/train.py', 'w').write(T.SCRIPT)"
FLAGS="--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_scheduling_mode=CONCURRENT --xla_gpu_autotune_level=0"
for i in $(seq ${RUNS:-3}); do
  XLA_FLAGS="$FLAGS" timeout $((${WD:-90} + 40)) python3 -P tools/watchdog.py ${WD:-90} /tmp/train.py > "/tmp/wc_$i.txt" 2>&1
  rc=$?
  echo "=== while_concurrent run $i rc=$rc ($((SECONDS - T0)) s)"; grep -E "^RESULT" "/tmp/wc_$i.txt" | cut -c1-200
  [[ $rc != 0 ]] && cp "/tmp/wc_$i.txt" "$OUT/" && grep -E "watchdog" "/tmp/wc_$i.txt" | head -3
done
[[ -n ${ONLY_TRAIN:-} ]] && exit 0
JAXVMM_REQUIRE_GPU=1 gpu_tests pipelined 200 -s tests/test_graph_xla.py -k pipelined
grep -E "^\.?(off|default|min_graph_size_1|while|while_unrolled|skip_temp|concurrent|while_concurrent) \{" "$OUT/pipelined.txt" | cut -c1-300
ring_tests
exit 0
