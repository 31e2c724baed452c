#!/usr/bin/env bash
# Spares after the keep/hold change, second call: the 4 MiB row with 2 cells and 16/24/32 spares, 4 cells
# and 32, 2 cells and 32 under +WHILE; the 1 MiB row with 0 and 16 spares (memory: spares mapped only as
# many as were lent at once). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
: > "$OUT/rows.txt"
export ROW_TIMEOUT=60
for n in 16 24 32; do mlp_row cells=2,spares=$n 1024,512,64 JAXVMM_GRAPH_CELLS=2 JAXVMM_GRAPH_SPARES=$n XLA_FLAGS=""; done
mlp_row cells=4,spares=32 1024,512,64 JAXVMM_GRAPH_CELLS=4 JAXVMM_GRAPH_SPARES=32 XLA_FLAGS=""
mlp_row cells=2,spares=32,while 1024,512,64 JAXVMM_GRAPH_SPARES=32 XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE"
mlp_row cells=2,spares=0 256,512,64 XLA_FLAGS=""
mlp_row cells=2,spares=16 256,512,64 JAXVMM_GRAPH_SPARES=16 XLA_FLAGS=""
