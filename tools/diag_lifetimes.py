"""Prints the Python lifetime registry's state after an offloaded ticket is dropped (diagnostic)."""
import gc, jax, jax.numpy as jnp, numpy as np, jaxvmm
from jaxvmm import ops
dev = jax.devices()[0]
x = jax.device_put(np.ones((3, 1001), np.float32), dev)
f = jax.jit(jaxvmm.offload)
jaxvmm.synchronize()
t = f(x)
jax.block_until_ready(t.token)
jaxvmm.synchronize()
print("before del: tracked", len(ops._tracked), "unread", len(ops._unread), "dying", len(ops._dying))
del t
gc.collect()
for i in range(4):
    jaxvmm.synchronize()
    print(i, "tracked", len(ops._tracked), "unread", sorted(ops._unread), "dying", len(ops._dying), "held", dict(ops._held),
          "live", jaxvmm.engine_stats()[f"{'cuda' if dev.platform == 'gpu' else 'cpu'}:0"]["tickets_live"])
    for tok, bar in ops._dying:
        print("  entry", id(tok), ops._finished(tok), [(type(r()).__name__, ops._finished(r())) for r in bar])
    for k, v in ops._tracked.items():
        print("  tracked", k, v.shape, v.dtype, ops._finished(v), v.devices())
