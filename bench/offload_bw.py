"""Offload and reload throughput beside raw pinned-memory copies, and what one offload costs XLA's stream.

    python bench/offload_bw.py             # 64 MiB, 256 MiB, 1 GiB, 4 GiB on GPU; 16, 64 MiB on cpu
    python bench/offload_bw.py --sizes 256M,1G --iters 50 --markdown --out offload_bw.md
    python bench/offload_bw.py --sizes 256M,1G --host-store pinned,host_numa --markdown --out bw.md

Everything is measured in one process, size by size:

  offload   a jitted ``t = jaxvmm.offload(x)``, N calls, then ``jaxvmm.synchronize()``: bytes / time
  reload    a jitted ``jaxvmm.reload(t)`` of N earlier tickets (newest first, the engine's default
            prediction), then ``block_until_ready``: bytes / time
  both      a jitted function that offloads ``x`` while it reloads an earlier ticket of the same size,
            N calls, then ``jaxvmm.synchronize()``: 2 x bytes / time. Where the engine splits copies
            into pieces (``copy_chunk``, default 64 MiB) smaller than the size, "both" runs a second
            time with one copy per op (``copy_chunk=0``) for comparison.
  raw       the same three as plain pinned-memory copies. With torch and a GPU: pinned tensors,
            ``copy_(non_blocking=True)`` on streams of their own, timed with CUDA events. Otherwise
            (cpu, or no torch) numpy memcpy of the same sizes, two threads for "both"; the header says which.
  stream    a fixed matmul workload jitted alone, with one offload of ``x``, and with one on-device copy of
            ``x`` (``x + z``, z a zero scalar argument so XLA cannot fold it): the extra time is what the
            call costs XLA's stream. Goal: offload's cost is about the D2D snapshot copy's, nothing more.

  host store  with ``--host-store pinned,host_numa`` every phase above runs once per host store
            (``jaxvmm.configure(host_store=...)``), side by side in one process, and each store's section
            starts with the cost of a cold 1 GiB offload: the store holds nothing, one offload (timed to
            ``synchronize()``) takes a chunk from the driver, then the same offload warm; the difference
            and the store's own driver time (``*_alloc_ns``) are reported. A store the driver refuses
            (HOST_NUMA pages not supported) is reported as such and skipped.

Tickets never pile up: each batch is dropped (``del``) or reloaded before the next, with
``jaxvmm.synchronize()`` between phases. A batch holds at most ``window`` tickets (min(3/4 of the host
pool limit, 16 GiB) and 0.3 x free device memory, divided by the size); larger ``--iters`` run as several
batches whose times add up, each starting with idle copy engines. Each phase runs once untimed first, so
the pinned pool and staging slots are warm.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import threading
import time

# Let jax allocate device memory on demand rather than taking 75% at start-up: jaxvmm's staging slots
# and the raw baseline's buffers need room beside XLA's. (No effect on the cpu platform.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxvmm  # noqa: E402
import jaxvmm.testing  # noqa: E402
from jaxvmm._devices import target_of  # noqa: E402

from _common import emit, human, parse_size, parse_sizes, render  # noqa: E402  (bench/ is on sys.path when run as a script)

MiB = 1 << 20
GiB = 1 << 30
GOAL_RATIO = 0.90  # jaxvmm GB/s >= 90% of the raw copy, per direction
GOAL_BOTH_GPU = 90.0  # GB/s, both directions at once, on GPU
GOAL_COST = 1.25  # offload's stream cost <= 1.25 x the D2D copy's ...
GOAL_COST_SLACK_MS = 0.05  # ... + 50 µs of timer noise
HOST_BUDGET_CAP = 16 * GiB  # pinned bytes the tickets of one batch may hold (the pool never shrinks)
GPU_SIZES = [64 * MiB, 256 * MiB, 1 * GiB, 4 * GiB]
CPU_SIZES = [16 * MiB, 64 * MiB]



def gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ---------------------------------------------------------------- raw baselines


class TorchCopies:
    """Pinned host tensors and device tensors, copies on two streams of their own, CUDA-event timing."""

    def __init__(self, torch, ordinal: int):
        self.torch = torch
        self.dev = torch.device("cuda", ordinal)
        self.describe = (f"torch {torch.__version__}: pinned tensors, copy_(non_blocking=True) on their own "
                         f"streams, CUDA events")

    def measure(self, size: int, iters: int) -> dict[str, float]:
        torch, dev = self.torch, self.dev
        with torch.cuda.device(dev):
            d_src = torch.full((size,), 1, dtype=torch.uint8, device=dev)
            d_dst = torch.empty(size, dtype=torch.uint8, device=dev)
            h_src = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(2)
            h_dst = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(0)
            s_d2h, s_h2d = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

            def d2h():
                h_dst.copy_(d_src, non_blocking=True)

            def h2d():
                d_dst.copy_(h_src, non_blocking=True)

            def timed(work, n):
                cur = torch.cuda.current_stream(dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(dev)
                start.record(cur)
                for stream, _ in work:
                    stream.wait_stream(cur)
                for stream, fn in work:  # enqueue all of one stream, then the other: they run at once
                    with torch.cuda.stream(stream):
                        for _ in range(n):
                            fn()
                for stream, _ in work:
                    cur.wait_stream(stream)
                end.record(cur)
                end.synchronize()
                return start.elapsed_time(end) / 1e3

            out = {}
            for name, work, factor in (("d2h", [(s_d2h, d2h)], 1), ("h2d", [(s_h2d, h2d)], 1),
                                       ("both", [(s_d2h, d2h), (s_h2d, h2d)], 2)):
                timed(work, 1)  # warm-up
                out[name] = gbs(factor * size * iters, timed(work, iters))
            del d_src, d_dst, h_src, h_dst
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()
        return out


class NumpyCopies:
    """Host memcpy (numpy.copyto) of the same sizes; two threads at once for "both"."""

    def __init__(self, why: str):
        self.describe = f"numpy memcpy, host to host ({why}); not a PCIe copy"

    def measure(self, size: int, iters: int) -> dict[str, float]:
        a, b = np.full(size, 1, np.uint8), np.zeros(size, np.uint8)  # touched, so no page faults are timed
        c, d = np.full(size, 2, np.uint8), np.zeros(size, np.uint8)

        def copies(dst, src, n):
            for _ in range(n):
                np.copyto(dst, src)

        def timed(pairs, n):
            threads = [threading.Thread(target=copies, args=(dst, src, n)) for dst, src in pairs]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return time.perf_counter() - t0

        out = {}
        for name, pairs in (("d2h", [(b, a)]), ("h2d", [(d, c)]), ("both", [(b, a), (d, c)])):
            timed(pairs, 1)
            out[name] = gbs(len(pairs) * size * iters, timed(pairs, iters))
        return out


def pick_baseline(on_gpu: bool, ordinal: int):
    if not on_gpu:
        return NumpyCopies("cpu platform")
    try:
        import torch  # imported after jax set up its backend; only the raw baseline uses it
    except Exception as e:  # noqa: BLE001  (any import failure means: no torch baseline)
        return NumpyCopies(f"torch not importable: {type(e).__name__}")
    if not torch.cuda.is_available():
        return NumpyCopies("torch sees no CUDA device")
    return TorchCopies(torch, ordinal)


# ---------------------------------------------------------------- jaxvmm phases


def make_array(size: int, device) -> jax.Array:
    """``size`` bytes (uint8) of a non-constant pattern, built on the device without a host round trip."""

    @jax.jit
    def fill():
        i = jax.lax.iota(jnp.uint32, size)
        return ((i * jnp.uint32(2654435761)) >> 24).astype(jnp.uint8)

    with jax.default_device(device):
        return jax.block_until_ready(fill())


def settle() -> None:
    """Every offload/reload done and every dropped ticket freed."""
    jaxvmm.synchronize()


def batches(iters: int, window: int):
    done = 0
    while done < iters:
        b = min(window, iters - done)
        yield b
        done += b


def offload_phase(off, x, size: int, iters: int, window: int) -> float:
    """GB/s of ``iters`` jitted offloads, timed from the first call to ``synchronize()`` (D2H done)."""
    total = 0.0
    for b in batches(iters, window):
        settle()
        t0 = time.perf_counter()
        tickets = [off(x) for _ in range(b)]
        jax.block_until_ready(tickets)  # every handler has run (so the engine knows the ops) ...
        jaxvmm.synchronize()  # ... and every D2H has finished
        total += time.perf_counter() - t0
        del tickets  # dropped: their host blocks go back to the pool
    settle()
    return gbs(size * iters, total)


def reload_phase(off, rel, x, size: int, iters: int, window: int) -> float:
    """GB/s of ``iters`` jitted reloads (newest ticket first), timed until the last result is ready."""
    total = 0.0
    for b in batches(iters, window):
        tickets = [off(x) for _ in range(b)]
        jax.block_until_ready(tickets)
        settle()
        t0 = time.perf_counter()
        y = None
        for t in reversed(tickets):
            y = rel(t)  # results of one device's stream finish in order: the last one ready means all are
        y.block_until_ready()
        total += time.perf_counter() - t0
        del tickets, y
        settle()
    return gbs(size * iters, total)


def both_phase(off, both, x, size: int, iters: int, depth: int, lag: int) -> float:
    """GB/s (both directions counted) of ``iters`` jitted offload-while-reloading calls.

    ``depth`` earlier tickets wait in a queue and are reloaded oldest first. The host may run at most
    ``lag`` calls ahead of the device: each offload takes its host block when the call is enqueued, so
    unbounded async dispatch would pin ``iters`` x size bytes."""
    queue = collections.deque(off(x) for _ in range(depth))
    jax.block_until_ready(list(queue))
    settle()
    in_flight: collections.deque = collections.deque()
    t0 = time.perf_counter()
    for _ in range(iters):
        t, y = both(x, queue.popleft())
        queue.append(t)
        in_flight.append(y)
        if len(in_flight) > lag:
            in_flight.popleft().block_until_ready()
    jax.block_until_ready((list(in_flight), list(queue)))
    jaxvmm.synchronize()
    elapsed = time.perf_counter() - t0
    del queue, in_flight, t, y  # the last `depth` tickets are dropped, never reloaded
    settle()
    return gbs(2 * size * iters, elapsed)


def stream_cost(work, a, x, iters: int) -> dict[str, float]:
    """Median ms of one call of: the workload alone, with an offload of x, with a D2D copy of x."""
    z = jnp.zeros((), x.dtype)
    variants = {
        "work": jax.jit(lambda a, x, z: work(a)),
        "offload": jax.jit(lambda a, x, z: (work(a), jaxvmm.offload(x))),
        "copy": jax.jit(lambda a, x, z: (work(a), x + z)),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(iters + 2):  # two untimed rounds first
        for name, f in variants.items():  # round-robin, so drift hits all three alike
            settle()  # copy engines idle, staging pages returned: each call starts from the same state
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(a, x, z))
            dt = time.perf_counter() - t0
            del out
            if i >= 2:
                times[name].append(dt * 1e3)
    settle()
    return {k: statistics.median(v) for k, v in times.items()}


COLD_SIZE = 1 * GiB


def cold_cost(store: str, device, target, off) -> dict:
    """ms of one offload of COLD_SIZE bytes into an empty store (its chunk taken from the driver), of the
    same offload warm, and the store's driver time for the chunk. The store is emptied first: host_numa
    chunks go back on trim(); the pinned pool returns its empty chunks when its limit is lowered."""
    knobs = jaxvmm.configure()
    settle()
    jaxvmm.trim()
    jaxvmm.configure(host_pool_limit=1)  # empty pinned chunks go back to the driver ...
    jaxvmm.configure(host_pool_limit=knobs["host_pool_limit"])  # ... and the limit is restored
    prefix = "pinned" if store == "pinned" else "host_numa"
    x = make_array(COLD_SIZE, device)
    off_x = off.lower(x).compile()  # compiled first: the cold time is the store's, not XLA's
    times = []
    s0 = jaxvmm.engine_stats().get(target.name, {})
    for _ in range(2):  # cold, then warm
        t0 = time.perf_counter()
        t = off_x(x)
        jax.block_until_ready(t)
        jaxvmm.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        del t
        settle()
    s1 = jaxvmm.engine_stats()[target.name]
    del x
    return {"cold": times[0], "warm": times[1],
            "alloc_ms": (s1[f"{prefix}_alloc_ns"] - s0.get(f"{prefix}_alloc_ns", 0)) / 1e6,
            "allocs": s1[f"{prefix}_allocs"] - s0.get(f"{prefix}_allocs", 0)}


def make_work(on_gpu: bool, device):
    """A fixed matmul chain on XLA's stream: ~5 ms on an H200, a few ms on a cpu."""
    n, reps, dtype = (8192, 4, jnp.bfloat16) if on_gpu else (256, 4, jnp.float32)
    with jax.default_device(device):
        a = (jax.random.normal(jax.random.key(0), (n, n), jnp.float32) / np.sqrt(n)).astype(dtype)

    def work(a):
        y = a
        for _ in range(reps):
            y = jnp.tanh(y @ a)
        return y

    flops = 2 * n**3 * reps
    desc = f"{reps} x ({n}x{n} @ {n}x{n}, {jnp.dtype(dtype).name}) + tanh, {flops / 1e9:,.1f} GFLOP"
    return work, jax.block_until_ready(a), desc


# ---------------------------------------------------------------- tables

BW_HEADERS = ["size", "store", "direction", "jaxvmm GB/s", "raw GB/s", "ratio", "goal", "prefetch hits"]
BW_RIGHT = {3, 4, 5, 7}
COST_HEADERS = ["size", "store", "work ms", "+offload ms", "+D2D copy ms", "offload cost ms", "copy cost ms",
                "cost/copy", "goal"]
COST_RIGHT = {2, 3, 4, 5, 6, 7}
COLD_HEADERS = ["store", "size", "cold offload ms", "warm offload ms", "cold - warm ms", "driver ms (store)",
                "chunks taken"]
COLD_RIGHT = {2, 3, 4, 5, 6}


def bw_rows(size: int, store: str, res: dict, raw: dict, on_gpu: bool) -> list[list[str]]:
    rows = []
    chunk = jaxvmm.testing.configure_debug()["copy_chunk"]
    both_label = f"both at once ({human(chunk)} pieces)" if 0 < chunk < size else "both at once"
    keys = [("d2h", "offload (D2H)"), ("h2d", "reload (H2D)"), ("both", both_label)]
    if "both_whole" in res:
        keys.append(("both_whole", "both at once (one copy per op)"))
    for key, label in keys:
        mine, base = res[key], raw["both" if key == "both_whole" else key]
        ratio = mine / base if base > 0 else float("inf")
        if key.startswith("both") and on_gpu:
            ok, goal = mine >= GOAL_BOTH_GPU, f">= {GOAL_BOTH_GPU:.0f} GB/s"
        else:
            ok, goal = ratio >= GOAL_RATIO, f">= {GOAL_RATIO:.0%}"
        rows.append([human(size), store, label, f"{mine:,.1f}", f"{base:,.1f}", f"{ratio:.0%}",
                     f"{goal} {'PASS' if ok else 'MISS'}", res.get(f"hits_{key}", "")])
    return rows


def cost_row(size: int, store: str, c: dict) -> list[str]:
    cost, copy = c["offload"] - c["work"], c["copy"] - c["work"]
    ok = cost <= GOAL_COST * max(copy, 0.0) + GOAL_COST_SLACK_MS
    ratio = f"{cost / copy:.2f}x" if copy > 0.005 else "n/a"
    return [human(size), store, f"{c['work']:.3f}", f"{c['offload']:.3f}", f"{c['copy']:.3f}", f"{cost:.3f}", f"{copy:.3f}",
            ratio, f"{'PASS' if ok else 'MISS'}"]


def hits(before: dict, after: dict) -> str:
    h = after["prefetch_hits"] - before["prefetch_hits"]
    m = after["prefetch_misses"] - before["prefetch_misses"]
    return f"{h}/{h + m}"


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=None, help="calls per phase and size (default 20 on GPU, 5 on cpu)")
    ap.add_argument("--sizes", type=parse_sizes, default=None,
                    help="comma-separated sizes, e.g. 64M,1G (bare numbers are MiB); overrides the defaults")
    ap.add_argument("--host-store", default=None,
                    help="comma-separated host stores to measure side by side: pinned, host_numa "
                         "(default: the store in force, JAXVMM_HOST_STORE or pinned)")
    ap.add_argument("--markdown", action="store_true", help="emit markdown tables")
    ap.add_argument("--out", metavar="FILE", help="also write the header and tables to FILE")
    args = ap.parse_args(argv)

    target = target_of(None)
    device, backend, ordinal = target.device, target.backend, target.ordinal
    on_gpu = backend == "cuda"
    iters = args.iters if args.iters is not None else (20 if on_gpu else 5)
    if iters < 1:
        ap.error("--iters must be >= 1")
    sizes = args.sizes if args.sizes is not None else (GPU_SIZES if on_gpu else CPU_SIZES)
    stores = [v.strip() for v in (args.host_store or jaxvmm.configure()["host_store"]).split(",") if v.strip()]
    for v in stores:
        if v not in ("pinned", "host_numa"):
            ap.error(f"--host-store: unknown store {v!r} (expected pinned, host_numa)")
    cold_sizes = [COLD_SIZE] if args.host_store else []

    work, a, work_desc = make_work(on_gpu, device)
    baseline = pick_baseline(on_gpu, ordinal)
    knobs = {**jaxvmm.configure(), **jaxvmm.testing.configure_debug()}
    host_budget = min(knobs["host_pool_limit"] * 3 // 4, HOST_BUDGET_CAP)
    free, total = jaxvmm.driver_memory_info(device)
    notes: list[str] = []
    if on_gpu and isinstance(baseline, NumpyCopies):
        notes.append("raw baseline is host memcpy, not PCIe: the ratio column is not meaningful on this machine")
    if not on_gpu:
        notes.append("cpu platform: the POSIX backend copies synchronously inside the call (snapshot, then "
                     "host copy, then page release); the goals are for GPUs, cpu runs check the harness")

    header = [
        f"jaxvmm {jaxvmm.__version__} offload/reload throughput vs raw pinned copies (one process)",
        f"device:      {device} ({device.device_kind}; native {backend} ordinal {ordinal})",
        f"memory:      {free / GiB:,.1f} GiB free of {total / GiB:,.1f} GiB",
        f"raw:         {baseline.describe}",
        f"engine:      host pool limit {knobs['host_pool_limit'] / GiB:,.1f} GiB, chunk "
        f"{human(knobs['host_pool_chunk'])}, prefetch depth {knobs['prefetch_depth']} per direction, "
        f"copies in pieces of {human(knobs['copy_chunk']) if knobs['copy_chunk'] else 'any size (one copy)'}",
        f"iterations:  {iters} per phase; stream cost: median of {iters} calls each",
        f"host stores: {', '.join(stores)}",
        f"workload:    {work_desc}",
    ]
    print("\n".join(header), flush=True)

    off = jax.jit(lambda x: jaxvmm.offload(x))
    rel = jax.jit(jaxvmm.reload)
    both = jax.jit(lambda x, t: (jaxvmm.offload(x), jaxvmm.reload(t)))
    same = jax.jit(lambda u, v: jnp.array_equal(u, v))

    bw: list[list[str]] = []
    costs: list[list[str]] = []
    colds: list[list[str]] = []
    batching: list[str] = []
    raws: dict[int, dict] = {}  # the raw baseline, measured once per size
    ok = True
    for store in stores:
        jaxvmm.configure(host_store=store)
        print(f"  host store {store} ...", file=sys.stderr, flush=True)
        if cold_sizes:
            free, _ = jaxvmm.driver_memory_info(device)
            if COLD_SIZE > 0.5 * free or COLD_SIZE > knobs["host_pool_limit"]:
                notes.append(f"{store}: cold {human(COLD_SIZE)} offload skipped (not enough free memory)")
            else:
                try:
                    c = cold_cost(store, device, target, off)
                    colds.append([store, human(COLD_SIZE), f"{c['cold']:,.1f}", f"{c['warm']:,.1f}",
                                  f"{c['cold'] - c['warm']:,.1f}", f"{c['alloc_ms']:,.1f}", str(c["allocs"])])
                except (jaxvmm.VmmError, RuntimeError) as e:
                    first = str(e).splitlines()[0]
                    notes.append(f"host store {store} UNAVAILABLE, skipped: {type(e).__name__}: {first}")
                    settle()
                    continue
        for size in sizes:
            free, _ = jaxvmm.driver_memory_info(device)
            cap = host_budget // size  # tickets the host pool budget holds at once
            window = min(iters, cap, int(0.3 * free) // size)
            if cap < 3 or window < 1 or 4 * size > 0.9 * free:
                notes.append(f"skipped {human(size)} ({store}): needs 3 x size of host pool budget "
                             f"({host_budget / GiB:,.1f} GiB; raise JAXVMM_HOST_POOL_LIMIT) and 4 x size free "
                             f"({free / GiB:,.1f} GiB)")
                continue
            depth = 2 if cap >= 5 else 1
            lag = max(1, min(2, cap - depth - 1))
            print(f"  measuring {human(size)} ({store}; batches of {window}) ...", file=sys.stderr, flush=True)
            try:
                if size not in raws:
                    raws[size] = baseline.measure(size, iters)
                raw = raws[size]
                x = make_array(size, device)
                # Correctness and warm-up: one round trip, compared on the device.
                t = off(x)
                y = rel(t)
                if not bool(same(x, y)):
                    ok = False
                    notes.append(f"{human(size)} ({store}): RELOADED DATA DIFFERS from what was offloaded")
                del t, y
                settle()
                res: dict = {}
                offload_phase(off, x, size, min(iters, window), window)  # warm-up: host store and staging
                res["d2h"] = offload_phase(off, x, size, iters, window)
                reload_phase(off, rel, x, size, min(iters, window), window)
                s0 = jaxvmm.engine_stats()[target.name]
                res["h2d"] = reload_phase(off, rel, x, size, iters, window)
                res["hits_h2d"] = hits(s0, jaxvmm.engine_stats()[target.name])
                both_phase(off, both, x, size, min(iters, 3), depth, lag)
                s0 = jaxvmm.engine_stats()[target.name]
                res["both"] = both_phase(off, both, x, size, iters, depth, lag)
                res["hits_both"] = hits(s0, jaxvmm.engine_stats()[target.name])
                chunk = jaxvmm.testing.configure_debug()["copy_chunk"]
                if 0 < chunk < size:  # the same with each D2H/H2D issued as one copy, for comparison
                    jaxvmm.testing.configure_debug(copy_chunk=0)
                    try:
                        s0 = jaxvmm.engine_stats()[target.name]
                        res["both_whole"] = both_phase(off, both, x, size, iters, depth, lag)
                        res["hits_both_whole"] = hits(s0, jaxvmm.engine_stats()[target.name])
                    finally:
                        jaxvmm.testing.configure_debug(copy_chunk=chunk)
                cost = stream_cost(work, a, x, iters)
                del x
                settle()
            except (jaxvmm.VmmError, RuntimeError, MemoryError) as e:
                ok = False
                notes.append(f"{human(size)} ({store}) failed: {type(e).__name__}: {str(e).splitlines()[0]}")
                settle()
                continue
            st = jaxvmm.engine_stats()[target.name]
            if st["tickets_live"] or st["ticket_host_bytes"]:
                ok = False
                notes.append(f"{human(size)} ({store}): {st['tickets_live']} tickets ({st['ticket_host_bytes']} "
                             "bytes) still live after the size's phases")
            bw += bw_rows(size, store, res, raw, on_gpu)
            batching.append(f"{human(size)}: {window}/{depth}/{lag}")
            costs.append(cost_row(size, store, cost))
        if store == "host_numa":
            settle()
            jaxvmm.trim()  # the host_numa chunks go back before the next store is measured
    jaxvmm.configure(host_store=knobs["host_store"])

    st = jaxvmm.engine_stats().get(target.name)
    if st is not None:
        if st["errors"]:
            ok = False
        notes.append(f"engine at the end: {st['offloads']} offloads, {st['reloads']} reloads, prefetch hits "
                     f"{st['prefetch_hits']}/{st['prefetch_hits'] + st['prefetch_misses']}, {st['errors']} errors, "
                     f"{st['tickets_live']} tickets live, host_numa store peak in use "
                     f"{st['host_numa_peak_in_use_bytes'] / MiB:,.0f} MiB ({st['host_numa_allocs']} chunks taken, "
                     f"{st['host_numa_frees']} returned), pinned pool {st['pinned_bytes'] / MiB:,.0f} MiB "
                     f"(peak in use {st['pinned_peak_in_use_bytes'] / MiB:,.0f} MiB, {st['pinned_allocs']} "
                     f"driver allocations), staging peak {st['staging_peak_bytes'] / MiB:,.0f} MiB in "
                     f"{st['staging_pages_mapped']} page mappings ({st['staging_device_waits']} device waits), "
                     f"{jaxvmm.stats()['mapped_bytes']} bytes still mapped")
    if batching:
        notes.append("tickets per offload/reload batch / both-at-once queue depth / calls the host may run ahead: "
                     + ", ".join(batching))
    notes.append("GB/s = 1e9 bytes/s; 'both at once' counts the bytes of both directions. raw columns use the "
                 "baseline named in the header, same sizes, same iterations.")
    notes.append("prefetch hits: reloads whose ticket the engine predicted (its H2D started ahead of need).")
    notes.append(f"goals: jaxvmm >= {GOAL_RATIO:.0%} of raw per direction"
                 + (f"; both at once >= {GOAL_BOTH_GPU:.0f} GB/s" if on_gpu else "; both at once likewise on cpu")
                 + f". stream cost goal: offload cost <= {GOAL_COST}x copy cost + {GOAL_COST_SLACK_MS * 1e3:.0f} µs.")
    notes.append("stream cost: extra ms per call over the workload alone (median of calls started with idle copy "
                 "engines); the offload's includes waiting for its staging pages to be mapped.")

    if colds:
        notes.append(f"cold offload: one {human(COLD_SIZE)} offload into an empty store, timed to synchronize(), "
                     "then the same offload warm; driver ms = the store's own time taking chunks "
                     "(cuMemHostAlloc for pinned; reserve + cuMemCreate + map + access for host_numa)")
    if len(stores) > 1:
        notes.append("ratio = jaxvmm / raw pinned copies (torch pinned tensors on GPU) for every store")
    tables = []
    if bw:
        tables.append(render(BW_HEADERS, BW_RIGHT, bw, args.markdown))
        tables.append(render(COST_HEADERS, COST_RIGHT, costs, args.markdown))
    if colds:
        tables.append(render(COLD_HEADERS, COLD_RIGHT, colds, args.markdown))
    body = "\n\n".join(tables) if tables else "(no sizes measured)"
    emit(header, body, notes, args.markdown, args.out)
    return 0 if bw and ok else 1


if __name__ == "__main__":
    sys.exit(main())
