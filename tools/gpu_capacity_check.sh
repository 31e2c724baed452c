#!/usr/bin/env bash
# One device call (<= ~9 minutes): build; the capacity trial of jaxvmm (names) at ${CAP_N:-27} layers
# under the watchdog (native stacks if it hangs); the gpu tests of the graph path and the drop-in;
# then bench/capacity.py for ${CAP_POLICIES} in the time left. Logs under $OUT (5 files).
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== build $((SECONDS - T0)) s"
echo "=== capacity trial jaxvmm-hidden n=${CAP_N:-27}"
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout ${T_CAP:-110} python3 -P tools/watchdog.py $(( ${T_CAP:-110} - 12 )) \
  bench/capacity.py --trial jaxvmm-hidden ${CAP_N:-27} --budget 24G > "$OUT/trial.txt" 2>&1
echo "rc=$?"; grep -E "CAPACITY_RESULT|watchdog|Error" "$OUT/trial.txt" | cut -c1-900
grep -B3 -A8 "_ZN6jaxvmm" "$OUT/trial.txt" | grep -v "python3\|libpython" | cut -c1-200 | head -60
echo "=== gpu tests $((SECONDS - T0)) s"
timeout ${T_TESTS:-200} python3 -P -m pytest -q -rfs --tb=short --timeout=80 -p no:cacheprovider -m gpu \
  ${TESTS:-tests/test_graph.py tests/test_dropin.py} > "$OUT/tests.txt" 2>&1
echo "rc=$?"; grep -E "FAILED|ERROR|passed|failed|Timeout|^E " "$OUT/tests.txt" | cut -c1-240 | tail -25
LEFT=$(( ${T_ALL:-545} - (SECONDS - T0) ))
echo "=== capacity search $((SECONDS - T0)) s, ${LEFT} s left"
if (( LEFT > 60 )); then
  timeout $LEFT python3 bench/capacity.py --policies ${CAP_POLICIES:-jaxvmm-hidden,jaxvmm-dots,native,remat} \
    --start ${CAP_START:-27} --precision ${CAP_PREC:-4} --time-limit $(( LEFT - 15 )) --markdown \
    --json "$OUT/capacity.json" > "$OUT/capacity.txt" 2>&1
  tail -30 "$OUT/capacity.txt" | cut -c1-400
fi
