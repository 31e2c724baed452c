set -uo pipefail
source tools/gpu_prelude.sh
python3 -P tools/jax_api_probe.py > "$OUT/jaxsrc.txt" 2>&1
echo "=== dropin cpu"
JAX_PLATFORMS=cpu timeout 120 python3 -P -m pytest -q -x --tb=long -p no:cacheprovider tests/test_dropin.py -k "any_number_of_times" > "$OUT/dropin_cpu.txt" 2>&1; echo rc=$?
tail -5 "$OUT/dropin_cpu.txt"
echo "=== pageable gpu x3"
for i in 1 2 3; do JAXVMM_REQUIRE_GPU=1 timeout 100 python3 -P -m pytest -q -p no:cacheprovider -m gpu tests/test_graph.py -k "pageable or create_no_event" 2>&1 | tail -2; done
