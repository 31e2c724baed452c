#!/usr/bin/env bash
# Save on device, full remat and jaxvmm (every no-batch-dim dot; no spare budget, then 1 GiB) as
# single trials of the capacity harness at 16 layers with room to spare (120 GiB budget), platform
# allocator, alternating, as run on the warm machine after tools/gpu_next33.sh. Logs under $OUT.
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
OUT=${OUT:-out}; mkdir -p "$OUT"
for spec in save:0 remat:0 jaxvmm-dots:0 jaxvmm-dots:1G save:0 jaxvmm-dots:1G remat:0; do
  p=${spec%%:*}; b=${spec##*:}
  JAXVMM_GRAPH_SPARE_BUDGET=$b timeout 100 python3 -P bench/capacity.py --trial "$p" 16 --budget 120G > "$OUT/t_${p}_$b.txt" 2>&1
  echo "$p budget=$b: $(grep -o '"step_s": [0-9.]*' "$OUT/t_${p}_$b.txt") $(grep -o '"internal_at_peak_bytes": [0-9]*' "$OUT/t_${p}_$b.txt") $SECONDS s"
done
exit 0
