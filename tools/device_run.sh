#!/usr/bin/env bash
# The device runner: what one call on a GPU machine runs, from the repository root, as a list of steps,
# each followed by its arguments:
#
#   bash tools/device_run.sh build tests tests/test_graph.py tests/test_graph_xla.py rows trial jaxvmm-hidden 29
#
# Steps (a word that names a step starts the next one, so a step's arguments may not be step names):
#   build                     pip install . with the system compiler (a toolchain that links libstdc++
#                             statically clashes with jaxlib's); log build.txt. Later calls on the same
#                             warm machine may leave it out.
#   tests [PYTEST ARGS...]    the gpu-marked tests (-m gpu unless the arguments say -m; default: every
#                             test file) with JAXVMM_REQUIRE_GPU=1, once per XLA command-buffer mode of
#                             $MODES; SHARDS=N splits the collected tests over N parallel pytest processes
#                             (tests that measure driver-level memory or time can be disturbed by the
#                             others: re-run their failures alone). Log tests_MODE[_SHARD].txt.
#   rows [SPEC...]            bench/train_step.py rows, save on device and jaxvmm (VARIANTS) in one run,
#                             once per mode of $MODES. SPEC is B,D,L for the MLP scan's MLP-hidden row
#                             with --mlp-shape B,D,L (STEPS 20), or MODEL:TARGET for a large row with the
#                             driver-level timeline (mlp:mlp_hidden, mlp:block_input, gpt:mlp_hidden,
#                             gpt:block_input; STEPS 10). Default: 256,512,64 256,1024,64 1024,512,64 (the
#                             README's small rows). REPEAT=N: N alternating processes a side sharing one
#                             XLA autotune cache (the median and every ratio). Log rows.txt.
#   trial POLICY N [ARGS...]  one bench/capacity.py trial at N layers (24 GiB budget, XLA's platform
#                             allocator unless XLA_PYTHON_CLIENT_ALLOCATOR says otherwise) under
#                             tools/watchdog.py; extra arguments go to capacity.py. Log trial_POLICY_N.txt.
#   py SCRIPT [ARGS...]       any Python script under tools/watchdog.py (bench/capacity.py --markdown,
#                             bench/offload_bw.py, bench/graph_rounds.py, tools/ring_cost.py, ...). Log
#                             py_SCRIPTNAME.txt.
#
# Modes ($MODES, space-separated, default "default"): default (XLA's own command buffers), while
# (--xla_gpu_enable_command_buffer=+WHILE: whole loops as one graph), off (--xla_gpu_enable_command_buffer=:
# every jaxvmm call is a handler on the op ring). The mode's flag is appended to $XLA_FLAGS.
# Environment: OUT (logs, default out/), MODES, SHARDS, REPEAT, VARIANTS (save,jaxvmm), STEPS, WARMUP,
# the time limits TESTS_TIMEOUT (420 s per mode), ROW_TIMEOUT (120 s per process), TRIAL_TIMEOUT (110 s),
# PY_TIMEOUT (300 s), and DRY_RUN=1 (print each command instead of running it). Everything else in the
# environment (JAXVMM_DEBUG_GRAPH_SPARES=8, JAXVMM_GRAPH_SPARE_BUDGET=1G, XLA_FLAGS, ...) reaches every step.
# Each step prints a line starting with "===" (its name, exit status, time since the start), then its
# summary: the test counts and failures, the rows' table lines, the trial's result line.
set -uo pipefail

STEP_NAMES=" build tests rows trial py "
OUT=${OUT:-out}
mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
MODES=${MODES:-default}
T0=$SECONDS
RC=0

# run LOG CMD...: CMD with stdout and stderr into $OUT/LOG (appended), or printed under DRY_RUN.
run() {
  local log=$1; shift
  if [[ -n ${DRY_RUN:-} ]]; then
    printf '+ XLA_FLAGS=%q' "${XLA_FLAGS:-}"; printf ' %q' "$@"; printf ' >> %s\n' "$OUT/$log"
    return 0
  fi
  "$@" >> "$OUT/$log" 2>&1
}

# mode_flags MODE: the XLA_FLAGS of that command-buffer mode (the caller's XLA_FLAGS first).
mode_flags() {
  local base=${XLA_FLAGS:-}
  case $1 in
    default) echo "$base" ;;
    while) echo "${base:+$base }--xla_gpu_enable_command_buffer=+WHILE" ;;
    off) echo "${base:+$base }--xla_gpu_enable_command_buffer=" ;;
    *) echo "device_run: no mode '$1' (default, while, off)" >&2; return 1 ;;
  esac
}

banner() { echo "=== $* ($((SECONDS - T0)) s)"; }

# pytest_summary LOG: the counts line, the failures and their first error lines.
pytest_summary() {
  [[ -n ${DRY_RUN:-} ]] && return 0
  grep -E '(passed|failed|error|skipped|deselected).* in ' "$OUT/$1" | tail -1
  grep -E '^(FAILED|ERROR)' "$OUT/$1" | cut -c1-250 | head -10
  grep -E '^E  ' "$OUT/$1" | cut -c1-300 | head -8
}

step_build() {
  : > "$OUT/build.txt"
  if ! run build.txt python3 -m pip install -q --no-build-isolation --no-deps .; then
    banner "build FAILED"; tail -40 "$OUT/build.txt"; exit 1
  fi
  banner "build"
  [[ -n ${DRY_RUN:-} ]] || python3 -P -c "import jax, jaxvmm; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
}

step_tests() {
  local args=("$@") mark=(-m gpu) mode flags a rc i n=${SHARDS:-1} ids
  for a in "${args[@]}"; do [[ $a == -m ]] && mark=(); done
  for mode in $MODES; do
    flags=$(mode_flags "$mode") || exit 1
    if (( n <= 1 )); then
      : > "$OUT/tests_$mode.txt"
      JAXVMM_REQUIRE_GPU=1 XLA_FLAGS=$flags run "tests_$mode.txt" timeout "${TESTS_TIMEOUT:-420}" \
        python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider "${mark[@]}" "${args[@]}"
      rc=$?; (( rc && rc != 5 )) && RC=$rc  # 5: no test selected (no gpu-marked test in those files)
      banner "tests $mode rc=$rc ${args[*]}"; pytest_summary "tests_$mode.txt"
      continue
    fi
    # Shards: the collected test ids dealt round-robin over N processes (ids stay out of $OUT).
    ids=$(mktemp -d)
    JAXVMM_REQUIRE_GPU=1 XLA_FLAGS=$flags python3 -P -m pytest --collect-only -q -p no:cacheprovider \
      "${mark[@]}" "${args[@]}" 2>/dev/null | grep "::" > "$ids/all.txt"
    for ((i = 0; i < n; i++)); do
      awk -v n="$n" -v i="$i" 'NR % n == i' "$ids/all.txt" > "$ids/$i.txt"
      : > "$OUT/tests_${mode}_$i.txt"
      (mapfile -t shard < "$ids/$i.txt"
       JAXVMM_REQUIRE_GPU=1 XLA_FLAGS=$flags run "tests_${mode}_$i.txt" timeout "${TESTS_TIMEOUT:-420}" \
         python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider "${shard[@]}"
       echo "rc=$?" >> "$OUT/tests_${mode}_$i.txt") &
    done
    wait
    banner "tests $mode: $(wc -l < "$ids/all.txt") tests in $n shards ${args[*]}"
    for ((i = 0; i < n; i++)); do
      echo "--- shard $i: $(grep -E '^rc=' "$OUT/tests_${mode}_$i.txt" | tail -1)"
      grep -qE '^rc=[05]$' "$OUT/tests_${mode}_$i.txt" || RC=1
      pytest_summary "tests_${mode}_$i.txt"
    done
    rm -rf "$ids"
  done
}

step_rows() {
  local specs=("$@") spec mode flags rc to=${ROW_TIMEOUT:-120} reps=${REPEAT:-1} variants=${VARIANTS:-save,jaxvmm}
  local -a cmd extra=()
  (( ${#specs[@]} )) || specs=(256,512,64 256,1024,64 1024,512,64)
  (( reps > 1 )) && extra=(--repeat "$reps" --autotune-cache /tmp/jaxvmm_autotune)
  for mode in $MODES; do
    flags=$(mode_flags "$mode") || exit 1
    for spec in "${specs[@]}"; do
      if [[ $spec == *:* ]]; then
        cmd=(python3 bench/train_step.py --models "${spec%%:*}" --targets "${spec##*:}" --timeline
             --steps "${STEPS:-10}")
      else
        cmd=(python3 bench/train_step.py --models mlp --targets mlp_hidden --mlp-shape "$spec" --steps "${STEPS:-20}")
      fi
      XLA_FLAGS=$flags run rows.txt timeout $(( reps * 2 * to + 30 )) "${cmd[@]}" --variants "$variants" \
        --warmup "${WARMUP:-3}" --timeout "$to" "${extra[@]}"
      rc=$?; (( rc )) && RC=$rc
      banner "rows $spec $mode rc=$rc"
      if [[ -z ${DRY_RUN:-} ]]; then
        grep -E '^\| (mlp|gpt)' "$OUT/rows.txt" | tail -"$(tr ',' '\n' <<< "$variants" | wc -l)" | cut -c1-600
        (( reps > 1 )) && grep -E 'per-run ratios' "$OUT/rows.txt" | tail -1
      fi
    done
  done
}

step_trial() {
  (( $# >= 2 )) || { echo "device_run: trial POLICY N [capacity.py args...]"; exit 2; }
  local policy=$1 n=$2 to=${TRIAL_TIMEOUT:-110} rc; shift 2
  local log="trial_${policy}_$n.txt"
  : > "$OUT/$log"
  XLA_PYTHON_CLIENT_ALLOCATOR=${XLA_PYTHON_CLIENT_ALLOCATOR:-platform} run "$log" timeout "$to" \
    python3 -P tools/watchdog.py $(( to - 10 )) bench/capacity.py --trial "$policy" "$n" --budget 24G "$@"
  rc=$?; (( rc )) && RC=$rc
  banner "trial $policy $n rc=$rc $*"
  [[ -n ${DRY_RUN:-} ]] || grep -E 'CAPACITY_RESULT|watchdog|Error' "$OUT/$log" | cut -c1-900
}

step_py() {
  (( $# >= 1 )) || { echo "device_run: py SCRIPT [args...]"; exit 2; }
  local script=$1 to=${PY_TIMEOUT:-300} rc name
  name=$(basename "$script" .py)
  run "py_$name.txt" timeout "$to" python3 -P tools/watchdog.py $(( to - 10 )) "$@"
  rc=$?; (( rc )) && RC=$rc
  banner "py $* rc=$rc"
  [[ -n ${DRY_RUN:-} ]] || tail -"${PY_TAIL:-25}" "$OUT/py_$name.txt" | cut -c1-400
}

(( $# )) || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
[[ $STEP_NAMES == *" $1 "* ]] || { echo "device_run: '$1' is not a step (${STEP_NAMES# })"; exit 2; }
while (( $# )); do
  step=$1; shift
  args=()
  while (( $# )) && [[ $STEP_NAMES != *" $1 "* ]]; do args+=("$1"); shift; done
  "step_$step" "${args[@]}"
done
banner "done rc=$RC"
exit "$RC"
