#!/usr/bin/env bash
# Graph cells displacing idle ring cells: the MLP-hidden and GPT MLP-hidden rows (save on device in the
# same run, driver-level timeline over the whole run and over the timed steps, 10 steps), then with
# JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests, the other gpu files, the offload and remat suites.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
gpu_suites graph rest offload remat
exit 0
