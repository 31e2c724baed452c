"""GPU diagnostics: the offload storm (64 MiB x 32 scan, prefetch_depth=2) step by step, then the idle
engine returning its pages, printing the engine counters that matter after each phase."""
import sys, time
import jax, jax.numpy as jnp
from jax import lax
import jaxvmm

KEYS = ("offloads", "reloads", "tickets_live", "errors", "staging_mapped_bytes", "staging_peak_bytes",
        "staging_device_waits", "graph_channels", "graph_captures", "graph_offload_rounds", "graph_reload_rounds",
        "graph_hits", "graph_misses", "graph_mapped_bytes", "graph_pages_mapped", "graph_pages_returned",
        "handler_calls", "seq_issued", "seq_completed")


def show(tag):
    s = jaxvmm.engine_stats().get("cuda:0", {})
    print(f"{time.monotonic() - T0:7.3f}s {tag}:", {k: s.get(k) for k in KEYS}, flush=True)


T0 = time.monotonic()
which = sys.argv[1]
if which == "storm":
    jaxvmm.configure(prefetch_depth=2)
    n = 16 << 20
    h = jnp.ones((n,), jnp.float32)
    fwd = jax.jit(lambda h: lax.scan(lambda h, _: (h + 1, jaxvmm.offload(h)), h, None, length=32)[1])
    bwd = jax.jit(lambda ts: lax.scan(lambda c, t: (c + jaxvmm.reload(t)[0], None), 0.0, ts, reverse=True)[0])
    block = "--no-block" not in sys.argv
    for i in range(2):
        ts = fwd(h)
        if block:
            jax.block_until_ready(ts)
        show(f"fwd {i}")
        total = bwd(ts)
        print("total", float(total), flush=True)
        show(f"bwd {i}")
else:
    jaxvmm.configure(staging_idle_ms=1000)
    x = jnp.arange(64 << 20, dtype=jnp.float32)
    step = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))
    for _ in range(3):
        y = step(x)
    print("equal", bool(jnp.array_equal(y, x)), flush=True)
    jaxvmm.synchronize()
    show("after 3 steps")
    for _ in range(12):
        time.sleep(0.5)
        show("idle")
