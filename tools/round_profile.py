"""Where a graph-mode round's time goes on the device (GPU): the MLP-scan row of bench/train_step.py
(`--mlp-shape B,D,L`, mlp_hidden) traced with jax.profiler (CUPTI: every kernel, replayed graph nodes
included), for save-on-device and for jaxvmm in separate processes:

    python tools/round_profile.py --variant save   --shape 256,512,64 --dir /tmp/prof_save
    python tools/round_profile.py --variant jaxvmm --shape 256,512,64 --dir /tmp/prof_vmm

Prints per traced step: the GPU span, busy time (union of kernel intervals on all streams), kernel count,
and the kernels grouped by name (count, mean and total microseconds), jaxvmm's round kernels first."""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", default="jaxvmm")
    ap.add_argument("--shape", default="256,512,64")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--bin-us", type=float, default=200.0, help="timeline: microseconds per character")
    args = ap.parse_args()
    import jax

    import train_step as ts

    s = ts.shapes_for("mlp", False, None, args.shape)
    step = ts.build_step("mlp", "mlp_hidden", args.variant, s, "auto")
    params, x = ts.init_arrays("mlp", s)
    for _ in range(4):
        loss, params = step(params, x)
    jax.block_until_ready((loss, params))
    with jax.profiler.trace(args.dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            loss, params = step(params, x)
        jax.block_until_ready((loss, params))
    path = sorted(glob.glob(os.path.join(args.dir, "**", "*perfetto_trace.json.gz"), recursive=True))[-1]
    report(path, args.variant, args.bin_us)
    return 0


def percentiles(v: list) -> str:
    q = sorted(v)
    return f"p50={q[len(q) // 2]:.1f} p90={q[len(q) * 9 // 10]:.1f} max={q[-1]:.1f}"


def timeline(ks: list, streams: collections.Counter, t0: float, t1: float, bin_us: float) -> None:
    """One line per stream (the 8 busiest): how busy it is in each bin_us slice of the traced span
    (' ' idle, '.' under a third, ':' under two thirds, '#' more), with what it ran most."""
    nb = int((t1 - t0) / bin_us) + 1
    print(f"  timeline, {bin_us:.0f} us per character:")
    for row, _ in streams.most_common(8):
        busy = [0.0] * nb
        names = collections.Counter()
        for e in ks:
            if (e["pid"], e["tid"]) != row:
                continue
            names[e["name"][:24]] += e["dur"]
            a, b = e["ts"] - t0, e["ts"] - t0 + e["dur"]
            while a < b:
                i = int(a // bin_us)
                edge = min(b, (i + 1) * bin_us)
                busy[i] += edge - a
                a = edge
        line = "".join(" " if v <= 0 else "." if v < bin_us / 3 else ":" if v < 2 * bin_us / 3 else "#" for v in busy)
        top = ", ".join(n for n, _ in names.most_common(2))
        print(f"    |{line}| {top}")


def report(path: str, variant: str, bin_us: float = 200.0) -> None:
    with gzip.open(path, "rt") as f:
        tr = json.load(f)
    ev = tr["traceEvents"] if isinstance(tr, dict) else tr
    pnames = {e["pid"]: e.get("args", {}).get("name", "") for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in pnames.items() if "GPU" in n or "gpu" in n}
    ks = [e for e in ev if e.get("ph") == "X" and e.get("pid") in gpu and e.get("dur") is not None]
    if not ks:
        print("no GPU events; process names:", sorted(set(pnames.values()))[:20])
        return
    ks.sort(key=lambda e: e["ts"])
    t0, t1 = ks[0]["ts"], max(e["ts"] + e["dur"] for e in ks)
    busy, end = 0.0, -1e30
    for e in ks:
        a, b = e["ts"], e["ts"] + e["dur"]
        if b > end:
            busy += b - max(a, end)
            end = b
    by = collections.defaultdict(list)
    for e in ks:
        by[e["name"][:60]].append(e["dur"])
    streams = collections.Counter((e["pid"], e["tid"]) for e in ks)
    print(f"{variant}: {len(ks)} GPU events on {len(streams)} rows, span {(t1 - t0) / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms")
    rows = sorted(by.items(), key=lambda kv: (not kv[0].startswith("jaxvmm"), -sum(kv[1])))
    for name, d in rows[:25]:
        pct = " " + percentiles(d) if name.startswith("jaxvmm") else ""
        print(f"  {name:60s} n={len(d):5d} mean={sum(d) / len(d):8.2f} us total={sum(d) / 1e3:8.3f} ms{pct}")
        if name.startswith("jaxvmm"):  # the longest, with their place among this kernel's events
            top = sorted(range(len(d)), key=lambda i: -d[i])[:6]
            print("      longest: " + ", ".join(f"#{i} {d[i]:.1f} us" for i in sorted(top)))
    timeline(ks, streams, t0, t1, bin_us)
    # XLA's compute stream (the row with the most events): its idle gaps between consecutive events,
    # summed by the name of the event that ends each gap (what the stream was about to run).
    main_row = streams.most_common(1)[0][0]
    mk = [e for e in ks if (e["pid"], e["tid"]) == main_row]
    gaps = collections.defaultdict(list)
    for a, b in zip(mk, mk[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 0:
            gaps[b["name"][:60]].append(g)
    mbusy = sum(e["dur"] for e in mk)
    print(f"  compute stream: {len(mk)} events, busy {mbusy / 1e3:.2f} ms, idle gaps {sum(map(sum, gaps.values())) / 1e3:.2f} ms; gaps before:")
    for name, g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"    {name:58s} n={len(g):5d} mean={sum(g) / len(g):8.2f} us total={sum(g) / 1e3:8.3f} ms {percentiles(g)}")


if __name__ == "__main__":
    sys.exit(main())
