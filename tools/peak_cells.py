"""What jaxvmm has mapped over a training step and at its device peak (GPU): bench/train_step.py's
MLP-scan (or GPT) row traced with jaxvmm.memory_timeline, run with the platform allocator. Prints the
peak sample, jaxvmm's mapped bytes over the step (1 ms bins: used, jaxvmm internal), and the engine's
graph-mode and staging counters.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform python tools/peak_cells.py --model mlp --target mlp_hidden

With --from-start N: one timeline over the first N steps (the first execution included) and a line per
step: the most device memory used in it, jaxvmm's own pages over it (min..max, and at that step's
used peak), and the engine's staging and graph-mode mapped bytes after it.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--target", default="mlp_hidden")
    ap.add_argument("--variant", default="jaxvmm")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--bin-ms", type=float, default=4.0)
    ap.add_argument("--from-start", type=int, default=0, metavar="N")
    ap.add_argument("--watch-first", action="store_true",
                    help="with --from-start: also sample engine_stats() every ~1 ms through the first step and "
                         "print each change of the staging area's and graph mode's mapped bytes")
    args = ap.parse_args()
    import jax
    import numpy as np

    import jaxvmm
    import train_step as ts

    s = ts.shapes_for(args.model, False, None, args.shape)
    step = ts.build_step(args.model, args.target, args.variant, s, "auto")
    params, x = ts.init_arrays(args.model, s)
    if args.from_start:
        return from_start(args.from_start, step, params, x, args.watch_first)
    for _ in range(3):
        loss, params = step(params, x)
    jax.block_until_ready((loss, params))
    jaxvmm.synchronize()
    with jaxvmm.memory_timeline(jax.devices()[0]) as tl:
        loss, params = step(params, x)
        jax.block_until_ready((loss, params))
        jaxvmm.synchronize()
    a = tl.series()
    t0 = a[0, 0]
    mib = 2 ** 20
    pk = tl.peak
    print(f"peak: {(pk.used_bytes - a[0, 1]) / mib:.0f} MiB above the first sample at {pk.t_s * 1e3:.1f} ms, "
          f"jaxvmm internal {pk.internal_bytes / mib:.0f} MiB, mapped {pk.mapped_bytes / mib:.0f} MiB; samples {len(a)}")
    print(f"{'ms':>7} {'used-first MiB (max)':>20} {'internal MiB (min..max)':>24}")
    edges = np.arange(0, (a[-1, 0] - t0) / 1e6 + args.bin_ms, args.bin_ms)
    tms = (a[:, 0] - t0) / 1e6
    for lo in edges:
        m = (tms >= lo) & (tms < lo + args.bin_ms)
        if not m.any():
            continue
        u = (a[m, 1].max() - a[0, 1]) / mib
        print(f"{lo:7.1f} {u:20.0f} {a[m, 3].min() / mib:11.0f}..{a[m, 3].max() / mib:<11.0f}")
    d = jaxvmm.engine_stats()
    for k in sorted(d):
        if k.startswith(("graph_", "staging_")) and not isinstance(d[k], (list, dict)):
            print(f"  {k} = {d[k]}")
    return 0


WATCHED = ("staging_mapped_bytes", "graph_mapped_bytes", "staging_offload_cells", "staging_reload_cells",
           "graph_captures", "graph_offload_rounds", "graph_reload_rounds", "graph_trades", "offloads", "reloads",
           "staging_direct_reloads")


def watch(stop, changes) -> None:
    """engine_stats() every ~1 ms until `stop` is set: (ms, {key: value}) whenever a WATCHED value changes."""
    import time

    import jaxvmm

    last = None
    t0 = time.monotonic_ns()
    while not stop.is_set():
        d = jaxvmm.engine_stats()
        d = d[next(iter(d))] if d else {}
        cur = {k: d.get(k) for k in WATCHED if k in d}
        if cur != last:
            changes.append(((time.monotonic_ns() - t0) / 1e6, cur))
            last = cur
        time.sleep(0.001)


def from_start(n: int, step, params, x, watch_first: bool = False) -> int:
    import threading
    import time

    import jax

    import jaxvmm

    mib = 2 ** 20
    bounds = []
    changes: list = []
    base = time.monotonic_ns()  # the timeline's times count from (about) here
    with jaxvmm.memory_timeline(jax.devices()[0]) as tl:
        for i in range(n):
            t0 = time.monotonic_ns() - base
            stop = threading.Event()
            th = None
            if watch_first and i == 0:
                th = threading.Thread(target=watch, args=(stop, changes), daemon=True)
                th.start()
            loss, params = step(params, x)
            jax.block_until_ready((loss, params))
            if th is not None:
                stop.set()
                th.join()
            d = jaxvmm.engine_stats()
            d = d[next(iter(d))]
            bounds.append((t0, time.monotonic_ns() - base, d["staging_mapped_bytes"], d["graph_mapped_bytes"]))
    a = tl.series()
    first = tl.first_used_bytes
    print(f"{'step':>4} {'ms':>8} {'used-first MiB':>14} {'jaxvmm MiB min..max':>20} {'at used peak':>12} "
          f"{'staging after':>13} {'graph after':>11}")
    for i, (t0, t1, staging, graph) in enumerate(bounds):
        m = a[(a[:, 0] >= t0) & (a[:, 0] < t1)]
        if not len(m):
            continue
        k = int(m[:, 1].argmax())
        print(f"{i:4d} {(t1 - t0) / 1e6:8.1f} {(m[k, 1] - first) / mib:14.0f} "
              f"{m[:, 3].min() / mib:9.0f}..{m[:, 3].max() / mib:<9.0f} {m[k, 3] / mib:12.0f} "
              f"{staging / mib:13.0f} {graph / mib:11.0f}")
    if changes:
        print("first step, engine_stats() changes (ms from the step's start; bytes in MiB):")
        for ms, cur in changes:
            print(f"  {ms:9.1f} " + " ".join(
                f"{k}={v / mib:.0f}" if k.endswith("_bytes") else f"{k}={v}" for k, v in cur.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
