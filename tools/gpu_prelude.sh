# Sourced by the device scripts (tools/gpu_*.sh): $OUT, the system compiler (the image's default CXX
# links libstdc++ statically, which clashes with jaxlib's), the environment, then `pip install .` (unless SKIP_BUILD).
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# SKIP_BUILD=1: a follow-up call on the still-warm machine keeps the build the previous call installed.
if [[ -z ${SKIP_BUILD:-} ]]; then
  python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
fi

# gpu_tests NAME TIMEOUT pytest-args...: the gpu-marked tests into $OUT/NAME.txt, then a summary line, the
# failures and their first error lines (T0: the script's start, for the elapsed time).
gpu_tests() {
  local name=$1 to=$2; shift 2
  timeout "$to" python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider -m gpu "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/$name.txt" | tail -1) ($((SECONDS - ${T0:-0})) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.txt" | cut -c1-250 | head -8; grep -E "^E  " "$OUT/$name.txt" | cut -c1-300 | head -6
}

# The gpu-marked test files outside graph mode, offload and remat (`gpu_tests rest TIMEOUT $REST_TESTS`).
REST_TESTS="tests/test_engine.py tests/test_dtypes.py tests/test_host_store.py tests/test_memory.py tests/test_semantics.py tests/test_share.py tests/test_slots.py"

# ring_tests [graph]: the ring-path gpu tests (offload + engine) with command buffers off, and with
# `graph` the graph gpu tests (graph + graph_xla, default mode) too.
ring_tests() {
  XLA_FLAGS=--xla_gpu_enable_command_buffer= gpu_tests ring_off 330 tests/test_offload.py tests/test_engine.py
  [[ ${1:-} == graph ]] && gpu_tests graph 300 tests/test_graph.py tests/test_graph_xla.py
  return 0
}

# ring_breakdown [LINES]: tools/ring_cost.py under JAXVMM_DEBUG_TRACE=1 (command buffers off, 20 runs), then
# its per (stage, driver call) summary into $OUT/ring_breakdown.txt; prints the first LINES (24) rows.
ring_breakdown() {
  XLA_FLAGS=--xla_gpu_enable_command_buffer= JAXVMM_DEBUG_TRACE=1 timeout 120 python3 tools/ring_cost.py --reps 20 \
    > "$OUT/ring_traced.txt" 2> "$OUT/ring_trace.txt"
  timeout 60 python3 tools/ring_cost.py --reps 20 --trace "$OUT/ring_trace.txt" > "$OUT/ring_breakdown.txt" 2>&1
  echo "=== breakdown ($((SECONDS - ${T0:-0})) s)"; head -"${1:-24}" "$OUT/ring_breakdown.txt"
}

# capacity_trial NAME POLICY LAYERS [capacity.py args...]: one bench/capacity.py trial (24 GiB budget,
# XLA's platform allocator unless XLA_PYTHON_CLIENT_ALLOCATOR says otherwise) under the watchdog into
# $OUT/trial_NAME.txt, then its result line.
capacity_trial() {
  local name=$1 policy=$2 n=$3; shift 3
  XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR:-platform} timeout 110 python3 -P tools/watchdog.py 100 \
    bench/capacity.py --trial "$policy" "$n" --budget 24G "$@" > "$OUT/trial_$name.txt" 2>&1
  echo "=== trial $name: $policy $n $* ($((SECONDS - ${T0:-0})) s)"
  grep -E "CAPACITY_RESULT|watchdog|Error" "$OUT/trial_$name.txt" | cut -c1-900
}

# mlp_row LABEL SHAPE [VAR=value ...]: bench/train_step.py's MLP-scan, MLP-hidden row (save on device
# and jaxvmm in one run) with --mlp-shape SHAPE ("" keeps the default shape) and those environment
# variables, appended to $OUT/rows.txt; then its two table lines. STEPS (20), WARMUP (3) and ROW_TIMEOUT
# (70 s) override.
mlp_row() {
  local label=$1 shape=$2 to=${ROW_TIMEOUT:-70}; shift 2
  env "$@" timeout "$to" python3 bench/train_step.py --models mlp --targets mlp_hidden ${shape:+--mlp-shape "$shape"} \
    --variants save,jaxvmm --steps "${STEPS:-20}" --warmup "${WARMUP:-3}" --timeout $((to - 5)) >> "$OUT/rows.txt" 2>&1
  echo "=== row $label $shape $* ($((SECONDS - ${T0:-0})) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-400
}

# mlp_rows LABEL SHAPE N [VAR=value ...]: as mlp_row, but N processes of each side, alternating, every
# process sharing one XLA autotune cache (bench/train_step.py --repeat N --autotune-cache); then its two
# table lines and the per-run ratios. ROW_TIMEOUT (60 s) is per process.
mlp_rows() {
  local label=$1 shape=$2 n=$3 to=${ROW_TIMEOUT:-60}; shift 3
  env "$@" timeout $((2 * n * to)) python3 bench/train_step.py --models mlp --targets mlp_hidden ${shape:+--mlp-shape "$shape"} \
    --variants save,jaxvmm --steps "${STEPS:-20}" --warmup "${WARMUP:-3}" --timeout $((to - 5)) --repeat "$n" \
    --autotune-cache /tmp/jaxvmm_autotune >> "$OUT/rows.txt" 2>&1
  echo "=== rows $label $shape x$n $* ($((SECONDS - ${T0:-0})) s)"; grep -E "^\| mlp" "$OUT/rows.txt" | tail -2 | cut -c1-110
  grep -E "per-run ratios" "$OUT/rows.txt" | tail -1
}

# spare_rows "CELLS:SPARES:SHAPE[:while] ...": mlp_row for each (graph_cells, graph_spares, --mlp-shape;
# `while`: XLA's +WHILE command buffers, else its default), 60 s each, into $OUT/rows.txt.
spare_rows() {
  local spec c n shape mode flags
  : > "$OUT/rows.txt"
  for spec in $1; do
    IFS=: read -r c n shape mode <<< "$spec"
    flags=""; [[ $mode == while ]] && flags="--xla_gpu_enable_command_buffer=+WHILE"
    ROW_TIMEOUT=60 mlp_row "cells=$c,spares=$n${mode:+,$mode}" "$shape" JAXVMM_GRAPH_CELLS="$c" JAXVMM_DEBUG_GRAPH_SPARES="$n" XLA_FLAGS="$flags"
  done
}

# round_prof LABEL VARIANT [VAR=value ...]: tools/round_profile.py of the 1 MiB MLP-scan row (VARIANT:
# save or jaxvmm) with those environment variables into $OUT/prof_LABEL.txt, then its summary: the GPU
# span, jaxvmm's kernels with their longest rounds, the copies, the compute stream's gaps.
round_prof() {
  local label=$1 v=$2; shift 2
  env "$@" timeout 120 python3 tools/round_profile.py --variant "$v" --shape 256,512,64 --dir "/tmp/prof_$label" > "$OUT/prof_$label.txt" 2>&1
  echo "=== profile $label $v $* ($((SECONDS - ${T0:-0})) s)"
  grep -E "span|jaxvmm|longest|memcpy128|Memcpy|compute stream" "$OUT/prof_$label.txt" | head -18
}

# A/B against ab_old/ (an exported older tree, `git archive REV | tar -x -C ab_old`; git-ignored, so the
# device call names it in `carry`). ab_build installs it into /tmp/ab_old; `old CMD` / `new CMD` run CMD
# from /tmp with that tree's package (its scripts under $T) or this one's; ab_ring_cost N runs
# tools/ring_cost.py (command buffers off) alternating old and new N times.
AB_ROOT=$PWD
ab_build() {
  python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/ab_old ./ab_old > "$OUT/build_old.txt" 2>&1 \
    || { tail -20 "$OUT/build_old.txt"; exit 1; }
}
old() { (cd /tmp && T=$AB_ROOT/ab_old PYTHONPATH=/tmp/ab_old "$@"); }
new() { (cd /tmp && T=$AB_ROOT "$@"); }
ab_ring_cost() {
  local i v
  for i in $(seq "$1"); do
    for v in old new; do
      $v bash -c 'XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 90 python3 "$T/tools/ring_cost.py"' > "$OUT/ring_$v$i.txt" 2>&1
      echo "=== ring_cost $v $i: $(tail -1 "$OUT/ring_$v$i.txt") ($((SECONDS - ${T0:-0})) s)"
    done
  done
}

# ab_rounds N: bench/graph_rounds.py (1 MiB offload rounds alone, 40 replays) alternating old and new
# N times, into $OUT/rounds_VN.txt; then each run's two table lines (fused, three nodes).
ab_rounds() {
  local i v
  for i in $(seq "$1"); do
    for v in old new; do
      $v bash -c 'timeout 60 python3 "$T/bench/graph_rounds.py" --size 1M --reps 40' > "$OUT/rounds_$v$i.txt" 2>&1
      echo "=== rounds $v $i ($((SECONDS - ${T0:-0})) s)"; grep -E "^\|" "$OUT/rounds_$v$i.txt" | tail -2
    done
  done
}

# hidden_rows MODELS...: bench/train_step.py's MLP-hidden row of each model (save on device and jaxvmm
# in one run, 10 steps after 3 warm-up steps, driver-level timeline over the run and over the timed
# steps) appended to $OUT/rows.txt; then its two table lines.
hidden_rows() {
  local m
  for m in "$@"; do
    timeout 120 python3 bench/train_step.py --models "$m" --targets mlp_hidden --variants save,jaxvmm --steps 10 \
      --warmup 3 --timeline --timeout 110 >> "$OUT/rows.txt" 2>&1
    echo "=== $m mlp_hidden ($((SECONDS - ${T0:-0})) s)"; grep -E "^\| $m" "$OUT/rows.txt" | tail -2 | cut -c1-560
  done
}

# gpu_suites SUITE...: with JAXVMM_REQUIRE_GPU=1, each named suite in turn: graph (tests/test_graph.py
# and tests/test_graph_xla.py), rest ($REST_TESTS), offload (tests/test_offload.py), remat (remat_suite).
gpu_suites() {
  local JAXVMM_REQUIRE_GPU=1 s
  export JAXVMM_REQUIRE_GPU
  for s in "$@"; do
    case $s in
      graph) gpu_tests graph 320 tests/test_graph.py tests/test_graph_xla.py ;;
      rest) gpu_tests rest 150 $REST_TESTS ;;
      offload) gpu_tests offload 120 tests/test_offload.py ;;
      remat) remat_suite ;;
      *) echo "gpu_suites: no suite $s"; return 1 ;;
    esac
  done
}

# remat_suite [NAME]: tests/test_remat.py (all of it: its gpu-marked tests and the rest) into
# $OUT/NAME.txt (remat), then a summary line and the failures.
remat_suite() {
  local name=${1:-remat}
  timeout 100 python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider tests/test_remat.py > "$OUT/$name.txt" 2>&1
  echo "=== $name rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/$name.txt" | tail -1) ($((SECONDS - ${T0:-0})) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.txt" | cut -c1-250 | head -6
}

# peak_step: tools/peak_cells.py over one traced MLP step (platform allocator) into $OUT/peak_mlp.txt,
# then its peak line and how many 8 ms bins had each range of jaxvmm's pages.
peak_step() {
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 90 python3 tools/peak_cells.py --model mlp --bin-ms 8 > "$OUT/peak_mlp.txt" 2>&1
  echo "=== peak_cells mlp ($((SECONDS - ${T0:-0})) s)"; head -1 "$OUT/peak_mlp.txt"; awk 'NR>2 {print $3}' "$OUT/peak_mlp.txt" | sort | uniq -c
}

# from_start MODELS...: tools/peak_cells.py --from-start 4 --watch-first on each model's MLP-hidden row
# (platform allocator) into $OUT/fs_MODEL.txt: a line per step, and engine_stats() changes through the
# first step; prints the step lines and any error.
from_start() {
  local m
  for m in "$@"; do
    XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 80 python3 tools/peak_cells.py --model "$m" --from-start 4 --watch-first > "$OUT/fs_$m.txt" 2>&1
    echo "=== from start $m ($((SECONDS - ${T0:-0})) s)"; head -5 "$OUT/fs_$m.txt"; grep -E "Error" "$OUT/fs_$m.txt" | head -3
  done
}
