# Sourced by the device scripts (tools/gpu_*.sh): $OUT, the system compiler (the image's default CXX
# links libstdc++ statically, which clashes with jaxlib's), the environment, then `pip install .`.
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }

# gpu_tests NAME TIMEOUT pytest-args...: the gpu-marked tests into $OUT/NAME.txt, then a summary line, the
# failures and their first error lines (T0: the script's start, for the elapsed time).
gpu_tests() {
  local name=$1 to=$2; shift 2
  timeout "$to" python3 -P -m pytest -q -rfs --tb=short -p no:cacheprovider -m gpu "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name rc=$? $(grep -E '(passed|failed|error).* in ' "$OUT/$name.txt" | tail -1) ($((SECONDS - ${T0:-0})) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/$name.txt" | cut -c1-250 | head -8; grep -E "^E  " "$OUT/$name.txt" | cut -c1-300 | head -6
}
