#!/usr/bin/env bash
# Trades under a running D2H: the MLP-hidden and GPT MLP-hidden rows (save on device in the same run,
# driver-level timeline, 10 steps), jaxvmm's pages over one MLP step (tools/peak_cells.py), the 1 MiB
# MLP row in XLA's default and +WHILE modes, then with JAXVMM_REQUIRE_GPU=1 the graph-mode gpu tests
# (default mode; test_graph_xla covers every mode) and the offload and remat suites. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
hidden_rows mlp gpt
peak_step
ROW_TIMEOUT=60 mlp_row "1MiB,default" 256,512,64
ROW_TIMEOUT=60 mlp_row "1MiB,+WHILE" 256,512,64 XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE
gpu_suites graph offload remat
exit 0
