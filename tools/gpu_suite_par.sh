#!/usr/bin/env bash
# Device call (nvidia-h200): build, then the whole gpu-marked suite as ${NSHARD:-5} pytest processes in
# parallel (round-robin over the collected test ids), plus the remat/semantics/drop-in/flax files with
# cuda:0 as JAX's default device. Every shard writes -v output to $OUT/shard_N.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
export JAXVMM_REQUIRE_GPU=1
N=${NSHARD:-5}; T=${T:-420}; IDS=$(mktemp -d)  # only 8 files come back from $OUT: ids stay out of it
python3 -P -m pytest --collect-only -q -m gpu -p no:cacheprovider 2>/dev/null | grep "::" > "$IDS/ids.txt"
echo "collected $(wc -l < "$IDS/ids.txt") gpu tests"
for i in $(seq 0 $((N - 1))); do
  awk -v n="$N" -v i="$i" 'NR % n == i' "$IDS/ids.txt" > "$IDS/ids_$i.txt"
  (mapfile -t ids < "$IDS/ids_$i.txt"
   timeout "$T" python3 -P -m pytest -v -rfs -p no:cacheprovider "${ids[@]}" > "$OUT/shard_$i.txt" 2>&1
   echo "rc=$?" >> "$OUT/shard_$i.txt") &
done
(timeout "$T" python3 -P -m pytest -q -rfs -p no:cacheprovider -m "not gpu" tests/test_remat.py tests/test_semantics.py \
   tests/test_dropin.py tests/test_flax.py > "$OUT/shard_default.txt" 2>&1; echo "rc=$?" >> "$OUT/shard_default.txt") &
wait
for f in "$OUT"/shard_*.txt; do
  echo "=== $(basename "$f"): $(grep -E '^rc=' "$f") $(grep -E '(passed|failed).* in ' "$f" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$f" | cut -c1-250 | head -8
  grep -E "^E  " "$f" | cut -c1-300 | head -${NERR:-6}
done
