#!/usr/bin/env bash
# A/B of the ring path in one run: ab_old/ (an exported older tree, `git archive REV | tar -x -C ab_old`;
# ignored by git, so the device call names it in `carry`), built into /tmp/ab_old, against this tree,
# interleaved: tools/ring_cost.py (command buffers off; N rounds, default 3) and, with ROWS=1, the 1 MiB
# row with command buffers off. Then the engine gpu tests of this tree in default mode and with command
# buffers off.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
OFF=--xla_gpu_enable_command_buffer=
ab_build
ab_ring_cost "${N:-3}"
: > "$OUT/rows.txt"
[[ -n ${ROWS:-} ]] && for v in old new old new; do
  $v bash -c 'XLA_FLAGS='$OFF' timeout 70 python3 "$T/bench/train_step.py" --models mlp --targets mlp_hidden \
    --mlp-shape 256,512,64 --variants save,jaxvmm --steps 20 --warmup 3 --timeout 65' >> "$OUT/rows.txt" 2>&1
  echo "=== row off $v ($((SECONDS - T0)) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -1 | cut -c1-200
done
gpu_tests engine_default 200 tests/test_engine.py
XLA_FLAGS=$OFF gpu_tests engine_off 200 tests/test_engine.py
