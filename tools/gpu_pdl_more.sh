#!/usr/bin/env bash
# Follow-up to tools/gpu_pdl.sh: the 1 MiB MLP-hidden row with JAXVMM_GRAPH_PDL=0 and =1 alternating
# ROWS (3) times, every process sharing one XLA autotune cache (--xla_gpu_per_fusion_autotune_cache_dir:
# the first process autotunes, the others load its choices, so save on device and jaxvmm run the same
# GEMM algorithms), one 4 MiB row; then the gpu suites not run there (rest, remat) and the ring path with
# command buffers off. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
AT="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/jaxvmm_autotune"
: > "$OUT/rows.txt"
for i in $(seq "${ROWS:-3}"); do
  for pdl in 0 1; do ROW_TIMEOUT=50 mlp_row "1MiB#$i pdl=$pdl shared-autotune" 256,512,64 JAXVMM_GRAPH_PDL=$pdl XLA_FLAGS="$AT"; done
done
ROW_TIMEOUT=50 mlp_row "4MiB pdl=1 shared-autotune" 1024,512,64 XLA_FLAGS="$AT"
ls /tmp/jaxvmm_autotune | wc -l
gpu_suites rest remat
ring_tests
exit 0
