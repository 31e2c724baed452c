#!/usr/bin/env bash
# A/B of the ring path in one run: ab_old/ (an exported older tree, `git archive REV | tar -x -C ab_old`;
# ignored by git, so the device call names it in `carry`), built into /tmp/ab_old, against this tree,
# interleaved: tools/ring_cost.py (command buffers off; N rounds, default 3). Options:
#   SPIN0=1    two more rounds with JAXVMM_DEBUG_WORKER_SPIN_US=0 (workers nap at once);
#   PROFILE=1  one run of this tree with JAXVMM_DEBUG_RING_PROFILE=1 (each part of a handler's host time);
#   ROWS=1     the 1 MiB row with command buffers off, old and new, twice;
#   TRACE=1    a traced driver-call breakdown of this tree (ring_breakdown);
#   HANG=N     the graph-mode XLA test of 1 to 3 cells per site (it hung with workers blocking in
#              cuEventSynchronize) N times;
#   TESTS=engine (default): this tree's engine gpu tests, default mode and command buffers off;
#   TESTS=ring_off: the ring-path gpu tests (offload + engine) with command buffers off; TESTS=ring:
#   those and the graph gpu tests (default mode); TESTS=none: no tests.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
[[ -n ${SPIN0:-} ]] && for i in 1 2; do
  for v in old new; do
    $v bash -c 'XLA_FLAGS='$OFF' JAXVMM_DEBUG_WORKER_SPIN_US=0 timeout 90 python3 "$T/tools/ring_cost.py"' > "$OUT/ring_s0_$v$i.txt" 2>&1
    echo "=== ring_cost spin=0 $v $i: $(tail -1 "$OUT/ring_s0_$v$i.txt") ($((SECONDS - T0)) s)"
  done
done
if [[ -n ${PROFILE:-} ]]; then
  XLA_FLAGS=$OFF JAXVMM_DEBUG_RING_PROFILE=1 timeout 90 python3 tools/ring_cost.py > "$OUT/prof.txt" 2>&1
  echo "=== profile ($((SECONDS - T0)) s)"; tail -3 "$OUT/prof.txt"
fi
: > "$OUT/rows.txt"
[[ -n ${ROWS:-} ]] && for v in old new old new; do
  $v bash -c 'XLA_FLAGS='$OFF' timeout 70 python3 "$T/bench/train_step.py" --models mlp --targets mlp_hidden \
    --mlp-shape 256,512,64 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 65' >> "$OUT/rows.txt" 2>&1
  echo "=== row off $v ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -1 | cut -c1-200
done
[[ -n ${TRACE:-} ]] && ring_breakdown
for i in $(seq "${HANG:-0}"); do
  gpu_tests hangk$i 150 tests/test_graph_xla.py -k one_to_three
done
case ${TESTS:-engine} in
  engine)
    gpu_tests engine_default 200 tests/test_engine.py
    XLA_FLAGS=$OFF gpu_tests engine_off 200 tests/test_engine.py ;;
  ring_off) ring_tests ;;
  ring) ring_tests graph ;;
esac
