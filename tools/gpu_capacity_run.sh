#!/usr/bin/env bash
# bench/capacity.py with every policy (GPT block scan, 24 GiB budget, platform allocator) in one call:
# the search from 27 layers to a precision of 4, within CAP_LIMIT seconds (500). Logs under $OUT.
set -uo pipefail
T0=$SECONDS
source "$(dirname "$0")/gpu_prelude.sh"
timeout $(( ${CAP_LIMIT:-500} + 40 )) python3 bench/capacity.py --policies ${CAP_POLICIES:-jaxvmm-hidden,jaxvmm-dots,native,remat,save} \
  --start ${CAP_START:-27} --precision ${CAP_PREC:-4} --time-limit ${CAP_LIMIT:-500} --markdown \
  --json "$OUT/capacity.json" > "$OUT/capacity.txt" 2>&1
echo "=== capacity rc=$? ($((SECONDS - T0)) s)"; tail -14 "$OUT/capacity.txt" | cut -c1-400
exit 0
