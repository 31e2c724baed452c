#!/usr/bin/env bash
# A/B of a round's copy kernel on twice the blocks (two 16-byte units a thread: a 1 MiB round on 128
# SMs instead of 64) against the tree before (ab_old/, carried; early launch on in both):
# bench/graph_rounds.py, then the 1 MiB MLP-hidden row (save on device vs jaxvmm in one run) in XLA's
# default command-buffer mode and with +WHILE, old and new alternating ROWS (3) times, every process
# sharing one XLA autotune cache; then the graph-mode and offload gpu suites with the new build
# (JAXVMM_REQUIRE_GPU=1). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
ab_build
ab_rounds 2
AT="--xla_gpu_per_fusion_autotune_cache_dir=/tmp/jaxvmm_autotune"
for i in $(seq "${ROWS:-3}"); do
  for mode in default while; do
    flags="$AT"; [[ $mode == while ]] && flags="$AT --xla_gpu_enable_command_buffer=+WHILE"
    for v in old new; do
      $v env XLA_FLAGS="$flags" bash -c 'timeout 50 python3 "$T/bench/train_step.py" --models mlp --targets mlp_hidden --mlp-shape 256,512,64 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 45' >> "$OUT/rows_${v}_$mode.txt" 2>&1
      echo "=== row $v $mode $i ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows_${v}_$mode.txt" | tail -1 | cut -c1-70
    done
  done
done
gpu_suites graph offload
exit 0
