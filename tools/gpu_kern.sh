#!/usr/bin/env bash
# Device call (nvidia-h200): graph-mode kernel grants (branch kern). Build; the PTX checks (ptxas where
# the toolkit is); graph tests over real CUDA graphs (Replay) and in every XLA command-buffer mode; then
# the small-activation bench with device grants on and off (JAXVMM_GRAPH_KERNELS=0: the host-granted
# protocol) for a side-by-side.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
echo "=== ptx + graph tests (Replay on cuda, XLA modes)"
timeout 90 python3 -P -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_graph.py > "$OUT/kern_replay.txt" 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kern_replay.txt" | cut -c1-400 | tail -10
timeout 240 python3 -P -m pytest -q -rfs -s -p no:cacheprovider tests/test_graph_kernels_ptx.py tests/test_graph_xla.py \
  > "$OUT/kern_xla.txt" 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kern_xla.txt" | cut -c1-400 | tail -10
python3 - "$OUT/kern_xla.txt" <<'PY'
import ast, re, sys
keys = ("graph_kernels", "graph_grants_device", "graph_grants_host", "graph_offload_rounds", "graph_reload_rounds", "graph_revokes")
for ln in open(sys.argv[1], errors="replace"):
    m = re.search(r"([a-z_0-9]+) (\{'.*\})\s*$", ln)
    if m:
        try:
            d = ast.literal_eval(m.group(2))
        except Exception:
            continue
        print(m.group(1), {k: d.get(k) for k in keys})
PY
for k in 1 0; do
  echo "=== bench 256,512,64 JAXVMM_GRAPH_KERNELS=$k"
  JAXVMM_GRAPH_KERNELS=$k timeout ${T:-170} python3 bench/train_step.py --models mlp --targets mlp_hidden \
    --variants save,jaxvmm --mlp-shape 256,512,64 --steps ${STEPS:-30} --warmup 3 --timeout 120 \
    --out "$OUT/kern_bench_$k.md" 2>&1 | grep -E "^\|"
done
