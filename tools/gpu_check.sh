#!/usr/bin/env bash
# One-shot GPU validation (the H200 runner has no network): build against the installed jaxlib, a
# smoke test, the suite with GPU skips turned into failures, then the benchmarks. Logs go to $OUT.
# STEPS selects what runs, in this order (default: "smoke tests vmm offload"; others: debug, drop,
# diag (tools/gpu_copy_diag.py), depth (offload_bw at two prefetch depths), train (bench/train_step.py,
# most of one command's 10 minutes), capacity (bench/capacity.py, ~6 minutes; CAP_ARGS=--quick: ~2)); TESTS selects test files, PYTEST_K a -k expression.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
# The image's default CXX links libstdc++ statically, which clashes with jaxlib's; use the system one.
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
STEPS=" ${STEPS:-smoke tests vmm offload} "
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import jax; print(jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  [[ $STEPS == *" $name "* ]] || return 0
  echo "=== $name"; timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -${TAIL:-25} "$OUT/$name.txt"; echo "=== $name rc=$rc"
}
step smoke 150 python3 tools/gpu_smoke.py
step debug 150 bash -c 'python3 tools/gpu_debug.py 200; JAXVMM_PREDICT=0 python3 tools/gpu_debug.py 200; JAXVMM_PREFETCH_DEPTH=1 python3 tools/gpu_debug.py 200'
step drop 60 python3 tools/gpu_drop_debug.py
step diag 120 python3 tools/gpu_copy_diag.py ${DIAG_MIB:-1024} 10
step depth 200 bash -c 'for d in ${DEPTHS:-2 4}; do echo "--- JAXVMM_PREFETCH_DEPTH=$d"; JAXVMM_PREFETCH_DEPTH=$d python3 tools/watchdog.py ${DEPTH_WATCHDOG:-75} bench/offload_bw.py --sizes ${DEPTH_SIZES:-1G} --iters 10 --markdown; done'
step tests 420 python3 -P -m pytest -q -rs ${PYTEST_K:+-k "$PYTEST_K"} ${TESTS:-tests}
step vmm 150 python3 bench/vmm_ops.py --markdown
step offload 300 python3 bench/offload_bw.py --markdown
step train 580 python3 bench/train_step.py --models ${TRAIN_MODELS:-mlp,gpt} --steps ${TRAIN_STEPS:-10} ${TRAIN_ARGS:-} --out "$OUT/train_step${TRAIN_TAG:-}.md" --plot "$OUT/train_step${TRAIN_TAG:-}.png"
step capacity 390 python3 bench/capacity.py --markdown --out "$OUT/capacity.md" --json "$OUT/capacity.json" --plot "$OUT/capacity.png" ${CAP_ARGS:-}
exit 0
