"""Why is a dropped ticket not freed on this device? Prints the Python-side lifetime registry."""
import gc
import sys

import jax
import jax.numpy as jnp

import jaxvmm
from jaxvmm import ops

dev = jax.devices()[0]
x = jax.device_put(jnp.arange(3003, dtype=jnp.float32), dev)
for how in ("eager", "jit"):
    t = jaxvmm.offload(x) if how == "eager" else jax.jit(jaxvmm.offload)(x)
    jax.block_until_ready(t.token)
    tok = t.token
    print(how, "refcount with t alive:", sys.getrefcount(tok) - 1, "referrers:", [type(r).__name__ for r in gc.get_referrers(tok)])
    del t
    gc.collect()
    print(how, "refcount after del t:", sys.getrefcount(tok) - 1, [type(r).__name__ for r in gc.get_referrers(tok)])
    del tok
    jaxvmm.synchronize()
    print(how, "tracked", len(ops._tracked), "dying", len(ops._dying), "UNREF", ops._UNREFERENCED,
          "refcounts", [sys.getrefcount(a) for a in ops._tracked.values()],
          "not ready", [not (a.is_deleted() or a.is_ready()) for a in ops._tracked.values()],
          "stats", {k: v for k, v in jaxvmm.engine_stats().items()})
