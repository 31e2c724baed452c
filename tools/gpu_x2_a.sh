#!/usr/bin/env bash
# Device call A (nvidia-h200-x2): build; graph-mode tests; small-activation rows (default, +WHILE) under
# a watchdog; shared-slot GPU tests and the share bandwidth bench.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
nvidia-smi -L
echo "=== graph tests"
timeout 110 python3 -P -m pytest -q -m gpu -rfs -s tests/test_graph.py tests/test_graph_xla.py > "$OUT/graph_tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^(off|default|min_graph|while|skip_temp) " "$OUT/graph_tests.txt" | cut -c1-300 | tail -12
for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
  echo "=== small row, XLA_FLAGS='$mode'"
  XLA_FLAGS="$mode" timeout 75 python3 tools/watchdog.py 60 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --mlp-shape 256,512,64 --steps 20 --warmup 3 --timeout 55 > "$OUT/small_${mode:+while}.txt" 2>&1
  grep -E "^\| mlp|watchdog|error" "$OUT/small_${mode:+while}.txt" | cut -c1-600 | head -8
done
echo "=== shared slots (2 GPUs)"
JAXVMM_REQUIRE_2GPU=1 timeout 130 python3 -P -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_share.py > "$OUT/share_tests.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/share_tests.txt" | cut -c1-300 | tail -12
timeout 70 python3 bench/share_bw.py --sizes 256M,1G --iters 10 --markdown --out "$OUT/share_bw.md" > "$OUT/share_bw.txt" 2>&1
echo "bench rc=$?"; tail -12 "$OUT/share_bw.txt"
