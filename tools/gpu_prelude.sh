# Sourced by the device scripts (tools/gpu_*.sh): $OUT, the system compiler (the image's default CXX
# links libstdc++ statically, which clashes with jaxlib's), the environment, then `pip install .`.
OUT=${OUT:-out}; mkdir -p "$OUT"
[[ -x /usr/bin/g++ ]] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.txt" 2>&1 || { tail -40 "$OUT/build.txt"; exit 1; }
