#!/usr/bin/env bash
# Page trades between large call sites: the MLP-hidden and GPT MLP-hidden rows (save on device in the
# same run, driver-level timeline), jaxvmm's pages over one MLP step (tools/peak_cells.py), then with
# JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests, the other gpu files and the offload and remat suites.
# Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
peak_step
gpu_suites graph rest offload remat
exit 0
