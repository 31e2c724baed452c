#!/usr/bin/env bash
# The checks owed to 02995c8..e3ae288 (direct-reload marks on the first recording only, held cells that
# go idle, StagingArea::Small/CellBytes): the graph, rest, offload and remat gpu suites
# (JAXVMM_REQUIRE_GPU=1, default XLA flags), the ring path with command buffers off, capacity trials of
# jaxvmm (names), JAX native and full remat at 28 layers (does the 0.6 GiB freed since buy a layer over
# 27?), and the 1 MiB row twice. Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
gpu_suites graph rest offload remat
ring_tests
capacity_trial n28 jaxvmm-hidden 28
capacity_trial n28native native 28
capacity_trial n28remat remat 28
: > "$OUT/rows.txt"
ROW_TIMEOUT=50 mlp_row 1MiB 256,512,64
ROW_TIMEOUT=50 mlp_row 1MiB 256,512,64
exit 0
