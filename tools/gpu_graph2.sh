#!/usr/bin/env bash
# Device call: build, graph-mode tests, small-activation rows in default and +WHILE modes.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
echo "=== graph tests"
timeout ${TG:-150} python3 -P -m pytest -q -m gpu -rfs -s tests/test_graph.py tests/test_graph_xla.py > "$OUT/graph_tests.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^(off|default|min_graph|while|skip_temp) |max_weight" "$OUT/graph_tests.txt" | cut -c1-400 | tail -20
for mode in "" "--xla_gpu_enable_command_buffer=+WHILE"; do
  for shape in ${SHAPES:-256,512,64 1024,512,64}; do
    echo "=== XLA_FLAGS='$mode' B,D,L = $shape"
    XLA_FLAGS="$mode" timeout ${T:-80} python3 bench/train_step.py --models mlp --targets mlp_hidden --variants ${VARIANTS:-save,native,jaxvmm} \
      --mlp-shape "$shape" --steps ${STEPS:-20} --warmup 3 --timeout 70 2>&1 | grep -E "^\| mlp"
  done
done
