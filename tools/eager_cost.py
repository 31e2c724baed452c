"""What an eager (outside jit) offload, reload and round trip cost on the default device, against a
jitted round trip, and how many backend compiles the measurements made (4: each eager call's one-op
program compiles once per source line, shape and device, and the measured lines are four calls).

    python3 tools/eager_cost.py [--n 50] [--elems 1024]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import monitoring

import jaxvmm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50, help="calls per measurement")
    ap.add_argument("--elems", type=int, default=1024, help="float32 elements per array")
    a = ap.parse_args()
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    x = jnp.ones((a.elems,), jnp.float32)
    for _ in range(3):  # compiled, engine warm
        jaxvmm.reload(jaxvmm.offload(x)).block_until_ready()
    f = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))
    f(x).block_until_ready()
    jaxvmm.synchronize()
    warm = len(compiles)

    def per_call_ms(fn):
        t0 = time.perf_counter()
        for _ in range(a.n):
            fn()
        jaxvmm.synchronize()
        return (time.perf_counter() - t0) / a.n * 1e3

    tickets = []
    off = per_call_ms(lambda: tickets.append(jaxvmm.offload(x)))
    it = iter(tickets)
    rel = per_call_ms(lambda: jaxvmm.reload(next(it)).block_until_ready())
    rt = per_call_ms(lambda: jaxvmm.reload(jaxvmm.offload(x)).block_until_ready())
    jit = per_call_ms(lambda: f(x).block_until_ready())
    print(f"device {jax.devices()[0]}, {a.elems * 4} bytes, {a.n} calls each")
    print("| call | ms per call |\n|---|---:|")
    for name, ms in (("eager offload", off), ("eager reload", rel), ("eager round trip", rt), ("jitted round trip", jit)):
        print(f"| {name} | {ms:.3f} |")
    print(f"backend compiles during the measurements: {len(compiles) - warm} (one per new source line: 4)")


if __name__ == "__main__":
    main()
