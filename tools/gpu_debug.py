"""Stress the reload paths that failed on the GPU: g offloads x and -x, h reloads them in reverse."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxvmm

dev = jax.devices()[0]
rng = np.random.default_rng(0)
bad = 0
for it in range(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
    x_np = rng.integers(-2**31, 2**31 - 1, size=(3, 1001), dtype=np.int32)
    x = jax.device_put(x_np, dev)
    f = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)) + 0)
    g = jax.jit(lambda x: [jaxvmm.offload(x), jaxvmm.offload(-x)])
    h = jax.jit(lambda ts: [jaxvmm.reload(t) for t in ts])
    a = np.asarray(f(x))
    ys = h(g(x)[::-1])
    y0, y1 = np.asarray(ys[0]), np.asarray(ys[1])
    ok = (a == x_np).all() and (y0 == -x_np).all() and (y1 == x_np).all()
    if not ok:
        bad += 1
        if bad <= 3:
            for name, y, want in (("f", a, x_np), ("y0", y0, -x_np), ("y1", y1, x_np)):
                wrong = np.flatnonzero(y.ravel() != want.ravel())
                if len(wrong):
                    print(f"iter {it} {name}: {len(wrong)} wrong elements, first {wrong[:3]}, "
                          f"got {y.ravel()[wrong[:3]]} want {want.ravel()[wrong[:3]]}; "
                          f"equals other? {(y == x_np).all()}/{(y == -x_np).all()}", flush=True)
    if it % 50 == 0:
        jax.clear_caches()
jaxvmm.synchronize()
print(os.environ.get("JAXVMM_PREDICT", "1"), os.environ.get("JAXVMM_PREFETCH_DEPTH", "2"), "bad", bad,
      jaxvmm.engine_stats())
