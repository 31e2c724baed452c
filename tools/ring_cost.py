"""Where a ring-path handler's host time goes (GPU; command buffers off so every call runs `execute`).

    XLA_FLAGS=--xla_gpu_enable_command_buffer= JAXVMM_DEBUG_TRACE=1 python tools/ring_cost.py 2> trace.txt

With JAXVMM_DEBUG_RING_PROFILE=1 it also prints each part of an offload / reload handler's host time.

Runs a jitted program of N offloads then N reloads of 1 MiB arrays, R times, then prints the engine's
handler host time (median, p99) and, from the driver-call trace on stderr (read back from the file
given as --trace), each (stage, entry)'s calls per op and median microseconds."""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys

import jax
import jax.numpy as jnp

import jaxvmm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--mib", type=int, default=1)
    ap.add_argument("--trace", default=None, help="the stderr file of a JAXVMM_DEBUG_TRACE=1 run to summarize")
    args = ap.parse_args()
    if args.trace:
        return summarize(args.trace, args.n, args.reps)
    xs = [jax.random.normal(jax.random.key(i), (args.mib * 262144,), jnp.float32) for i in range(args.n)]

    @jax.jit
    def roundtrip(xs):
        ts = [jaxvmm.offload(x) for x in xs]
        return [jaxvmm.reload(t) for t in reversed(ts)]

    jax.block_until_ready(roundtrip(xs))
    jaxvmm.synchronize()
    before = jaxvmm.engine_stats()["cuda:0"]
    for _ in range(args.reps):
        out = roundtrip(xs)
    jax.block_until_ready(out)
    jaxvmm.synchronize()
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(out, reversed(xs)))
    s = jaxvmm.engine_stats()["cuda:0"]
    calls = s["handler_calls"] - before["handler_calls"]
    print(f"handler calls {calls}, median {s['handler_median_ns'] / 1e3:.1f} us, p99 {s['handler_p99_ns'] / 1e3:.1f} us, "
          f"offload {s['handler_offload_median_ns'] / 1e3:.1f} us, reload {s['handler_reload_median_ns'] / 1e3:.1f} us "
          f"(graph captures {s['graph_captures']}, ring copy kernel {s['ring_copy_kernel']})")
    for kind in ("offload", "reload"):
        sec = s.get(f"handler_{kind}_sections_ns")
        if sec:  # JAXVMM_DEBUG_RING_PROFILE=1
            print(f"{kind} sections (median us): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sec.items()))
    return 0


def summarize(path: str, n: int, reps: int) -> int:
    pat = re.compile(r"jaxvmm-trace: slot -?\d+ (.+?) (cu\w+) (\w+) ([\d.]+) us")
    by = collections.defaultdict(list)
    for line in open(path, errors="replace"):
        m = pat.search(line)
        if m:
            by[(m.group(1), m.group(2))].append(float(m.group(4)))
    ops = 2 * n * (reps + 1)
    print(f"| stage | entry | calls per op | median us | total us per op |")
    print("|---|---|---|---|---|")
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))
    for (stage, entry), v in rows[:30]:
        print(f"| {stage} | {entry} | {len(v) / ops:.2f} | {statistics.median(v):.2f} | {sum(v) / ops:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
