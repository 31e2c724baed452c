"""Why an eager vmap of offload/reload counts fewer engine offloads on cuda than on cpu: the stats delta."""
import jax, numpy as np, jaxvmm

dev = jax.devices()[0]
KEY = ('cuda' if dev.platform == 'gpu' else dev.platform) + f':{dev.id}'
x = jax.device_put(np.arange(4 * 3 * 101, dtype=np.float32).reshape(4, 3, 101), dev)
f = jax.vmap(lambda v: jaxvmm.reload(jaxvmm.offload(v)))
for name, g in (("eager", f), ("jit", jax.jit(f))):
    before = jaxvmm.engine_stats().get(KEY, {})
    y = g(x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    jaxvmm.check()
    after = jaxvmm.engine_stats().get(KEY, {})
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}
    print(name, delta)
print(jax.jit(f).lower(x).as_text()[:3000])
