"""jaxvmm offload: a jitted forward moves an activation to host memory, a jitted backward brings it back."""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave device memory for jaxvmm's staging slots
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxvmm  # noqa: E402

MiB, D = 1 << 20, 1024
rows = (256 if jax.default_backend() == "gpu" else 16) * MiB // (4 * D)  # a 256 MiB (cpu: 16 MiB) activation
x = jax.random.normal(jax.random.key(0), (rows, D))
w = jax.random.normal(jax.random.key(1), (D, D)) / D**0.5
work = lambda h, w: jnp.tanh(jnp.tanh(h @ w) @ w).sum()  # noqa: E731


def forward(x, w):  # the activation goes to host memory; an 8-byte ticket comes back in its place
    h = x * 2.0
    return work(h, w), jaxvmm.offload(h)


def forward_keep(x, w):  # the usual way: h stays on the device until backward
    h = x * 2.0
    return work(h, w), h


def backward(ticket, x):
    h = jaxvmm.reload(ticket)
    return h, jnp.array_equal(h, x * 2.0)


for f in (forward_keep, forward):
    m = jax.jit(f).lower(x, w).compile().memory_analysis()
    print(f"{f.__name__:12s} XLA temp {m.temp_size_in_bytes / MiB:6.1f} MiB, "
          f"output (held until backward) {m.output_size_in_bytes / MiB:6.1f} MiB")
mapped = lambda: f"{jaxvmm.stats()['mapped_bytes'] / MiB:.1f} MiB"  # noqa: E731
print(f"mapped_bytes before forward: {mapped()}")
loss, ticket = jax.jit(forward)(x, w)
jax.block_until_ready(ticket)  # the call has run (jit dispatch is asynchronous) ...
jaxvmm.synchronize()  # ... and its copy to host is done
print(f"mapped_bytes after forward:  {mapped()} (a staging cell stays mapped while ops flow)")
jaxvmm.trim()  # give the idle staging pages back now (they also go back after staging_idle_ms)
host = sum(s["ticket_host_bytes"] for s in jaxvmm.engine_stats().values())
print(f"mapped_bytes after trim():   {mapped()} (peak {jaxvmm.stats()['peak_mapped_bytes'] / MiB:.1f} MiB while "
      f"copying); {ticket} holds {host / MiB:.0f} MiB on the host")
h, same = jax.jit(backward)(ticket, x)
jax.block_until_ready(h)  # let the reload run before the ticket goes (a drop that arrives first frees it)
del ticket
jaxvmm.synchronize()
jaxvmm.trim()
print(f"mapped_bytes after backward and trim(): {mapped()}")
for dev, s in jaxvmm.engine_stats().items():
    print(f"{dev}: pinned pool {s['pinned_bytes'] / MiB:.0f} MiB (in use {s['pinned_in_use_bytes'] / MiB:.0f}), "
          f"offloads {s['offloads']}, reloads {s['reloads']}, prefetch hits {s['prefetch_hits']}, "
          f"tickets live {s['tickets_live']}, errors {s['errors']}")
jaxvmm.check()  # raises the first asynchronous engine error, if any
if not bool(same) or jaxvmm.stats()["mapped_bytes"] or any(s["tickets_live"] for s in jaxvmm.engine_stats().values()):
    sys.exit("FAILED: the reloaded array differs, or pages or tickets were left behind")
print(f"OK: reloaded {h.nbytes / MiB:.0f} MiB equals the original (loss {float(loss):.3f})")
