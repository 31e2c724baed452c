"""Quick end-to-end check of offload/reload on the default device (used first in GPU runs, with a timeout)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxvmm

print(jaxvmm.cuda_available(), jax.devices())
x = jnp.arange(1 << 20, dtype=jnp.float32)
t = jax.jit(jaxvmm.offload)(x)
y = jax.jit(jaxvmm.reload)(t)
print("jit exact:", bool(jnp.array_equal(x, y)))
L, N = 8, (3 << 20) + 7
xs = jax.random.normal(jax.random.key(0), (L, N), jnp.float32)


def run(reverse):
    @jax.jit
    def f(xs):
        _, toks = jax.lax.scan(lambda c, x: (c, jaxvmm.offload(x * 2).token), 0, xs)
        _, ys = jax.lax.scan(lambda c, tok: (c, jaxvmm.reload(jaxvmm.Ticket(tok, (N,), jnp.float32))), 0, toks,
                             reverse=reverse)
        return ys
    for i in range(3):
        t0 = time.perf_counter()
        ys = jax.block_until_ready(f(xs))
        print(f"{'lifo' if reverse else 'fifo'} exact:", bool(jnp.array_equal(ys, xs * 2)), f"{time.perf_counter() - t0:.3f}s")


run(True)
run(False)
jaxvmm.synchronize()
s = jaxvmm.stats()
print("mapped", s["mapped_bytes"], "peak", s["peak_mapped_bytes"], s["offload"])
