#!/usr/bin/env bash
# One-shot GPU validation (the H200 runner has no network): build against the installed jaxlib,
# run the suite with GPU skips turned into failures, then the benchmarks. Logs go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
# The image's default CXX links libstdc++ statically, which clashes with jaxlib's; use the system one.
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAXVMM_REQUIRE_GPU=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import jax; print(jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/env.txt"
python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -20 | tee "$OUT/build.txt" || exit 1
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "=== $name" ; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.txt"; echo "=== $name rc=${PIPESTATUS[0]}"
}
case " ${STEPS:-smoke tests vmm offload examples} " in *" smoke "*) step smoke 120 python3 -c "
import jax, jax.numpy as jnp, numpy as np, jaxvmm
print(jaxvmm.cuda_available())
x = jnp.arange(1 << 20, dtype=jnp.float32)
t = jax.jit(jaxvmm.offload)(x); y = jax.jit(jaxvmm.reload)(t)
print('eager/jit exact:', bool(jnp.array_equal(x, y))); jaxvmm.synchronize(); print(jaxvmm.stats())";; esac
case " ${STEPS:-smoke tests vmm offload examples} " in *" tests "*) step tests 420 python3 -P -m pytest -q -rs -x tests;; esac
case " ${STEPS:-smoke tests vmm offload examples} " in *" vmm "*) step vmm_ops 120 python3 bench/vmm_ops.py --markdown;; esac
case " ${STEPS:-smoke tests vmm offload examples} " in *" offload "*) step offload_bw 300 python3 bench/offload_bw.py --markdown;; esac
exit 0
