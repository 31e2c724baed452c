"""Latency of each Slot lifecycle op beside the raw driver calls it is built on, measured in one run.

    python bench/vmm_ops.py                 # 2 MiB, 64 MiB, 1 GiB on jax's default device
    python bench/vmm_ops.py --big           # ... and 8 GiB
    python bench/vmm_ops.py --sizes 2M,256M --iters 100 --markdown --out vmm_ops.md

For every size the native core (ffi/bench.cc) alternates a raw driver cycle and the same cycle through
the slot engine, ``iters`` times, and reports medians; then the same size is driven from Python
(``Slot(...)``, ``release()``, ``remap()``, ``close()``) so the Python overhead is visible.
On the jax ``cpu`` platform (POSIX backend) creating pages means fallocate zeroing them, so sizes
above 256 MiB are skipped there unless ``--sizes`` names them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Let jax allocate GPU memory on demand rather than taking 75% at start-up, so large --sizes fit and
# the free-memory figure in the header is the device's. (No effect on the cpu platform.)
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jaxvmm  # noqa: E402
from jaxvmm._devices import target_of
from jaxvmm._native import lib  # noqa: E402
from jaxvmm.testing import hooks  # noqa: E402

from _common import emit, human, parse_size, parse_sizes, render  # noqa: E402  (bench/ is on sys.path when run as a script)

MiB = 1 << 20
GiB = 1 << 30
GOAL = 1.2  # slot op may cost at most this many times the raw driver sequence
CPU_DEFAULT_MAX = 256 * MiB

# (row label, slot key, raw key, what the raw column times, python key)
LIFECYCLE = [
    ("create", "slot_create", "raw_setup", "reserve+create+map+access", "create"),
    ("release", "slot_release", "raw_drop", "unmap+release", "release"),
    ("remap", "slot_remap", "raw_remap", "create+map+access", "remap"),
    ("close", "slot_close", "raw_free", "address free (slot already released)", "close"),
]
RAW_CALLS = [
    ("reserve", "raw_reserve", "cuMemAddressReserve"),
    ("create", "raw_create", "cuMemCreate"),
    ("map", "raw_map", "cuMemMap"),
    ("access", "raw_access", "cuMemSetAccess"),
    ("unmap", "raw_unmap", "cuMemUnmap"),
    ("release", "raw_release", "cuMemRelease"),
    ("free", "raw_free", "cuMemAddressFree"),
]



def us(v: float | None) -> str:
    if v is None:
        return ""
    return f"{v:,.1f}" if v < 1e4 else f"{v:,.0f}"


def python_ops(target, nbytes: int, iters: int) -> dict[str, float]:
    """Median µs of Slot(...), release(), remap(), close() called from Python (same cycle as bench.cc)."""
    device = target.device
    jaxvmm.Slot(nbytes, device=device).close()  # warm-up
    t: dict[str, list[float]] = {"create": [], "release": [], "remap": [], "close": []}
    clock = time.perf_counter_ns
    for _ in range(iters):
        c0 = clock()
        s = jaxvmm.Slot(nbytes, device=device)
        c1 = clock()
        s.release()
        c2 = clock()
        s.remap()
        c3 = clock()
        s.release()
        c4 = clock()
        s.close()
        c5 = clock()
        t["create"].append((c1 - c0) / 1e3)
        t["release"].append((c2 - c1) / 1e3)
        t["remap"].append((c3 - c2) / 1e3)
        t["close"].append((c5 - c4) / 1e3)
    return {k: statistics.median_low(v) for k, v in t.items()}


def rows_for(size: int, native: dict[str, float], py: dict[str, float]) -> list[list[str]]:
    rows = []
    for label, slot_key, raw_key, _, py_key in LIFECYCLE:
        raw, slot = native[raw_key], native[slot_key]
        ratio = slot / raw if raw > 0 else float("inf")
        rows.append([human(size), label, us(raw), us(slot), f"{ratio:.2f}x",
                     f"<= {GOAL}x {'PASS' if ratio <= GOAL else 'MISS'}", us(py[py_key])])
    for label, raw_key, entry in RAW_CALLS:
        rows.append([human(size), f"  raw {label}", us(native[raw_key]), "", "", "", ""])
    return rows


HEADERS = ["size", "op", "raw µs", "slot µs", "slot/raw", "goal", "python µs"]
RIGHT = {2, 3, 4, 6}


def render_table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:  # the indented "raw <call>" rows read better flush left in markdown
        rows = [[c.replace("  raw ", "raw ") for c in r] for r in rows]
    return render(HEADERS, RIGHT, rows, markdown)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=None, help="cycles per size (default 50 on GPU, 200 on CPU)")
    ap.add_argument("--sizes", type=parse_sizes, default=None,
                    help="comma-separated sizes, e.g. 2M,64M,1G (bare numbers are MiB); overrides the defaults")
    ap.add_argument("--big", action="store_true", help="add 8 GiB to the default sizes")
    ap.add_argument("--markdown", action="store_true", help="emit a markdown table")
    ap.add_argument("--out", metavar="FILE", help="also write the header and table to FILE")
    args = ap.parse_args(argv)

    target = target_of(None)
    backend, ordinal = target.backend, target.ordinal
    on_gpu = backend == "cuda"
    iters = args.iters if args.iters is not None else (50 if on_gpu else 200)
    if iters < 1:
        ap.error("--iters must be >= 1")

    notes = []
    if args.sizes is not None:
        sizes = args.sizes
    else:
        sizes = [2 * MiB, 64 * MiB, 1 * GiB] + ([8 * GiB] if args.big else [])
        if not on_gpu:
            skipped = [s for s in sizes if s > CPU_DEFAULT_MAX]
            sizes = [s for s in sizes if s <= CPU_DEFAULT_MAX]
            if skipped:
                notes.append(f"skipped {', '.join(human(s) for s in skipped)} on the POSIX backend "
                             f"(fallocate zeroes pages; pass --sizes to force)")

    cuda = jaxvmm.cuda_available()
    if cuda.driver_version:
        v = cuda.driver_version
        driver = f"CUDA {v // 1000}.{v % 1000 // 10} ({v})" + ("" if cuda else f", unusable: {cuda.reason}")
    else:
        driver = f"none ({cuda.reason.rsplit('; ', 1)[-1]})" if cuda.reason else "none"
    gran = int(lib.granularity(backend, ordinal, "device", ordinal))
    free, total = jaxvmm.driver_memory_info(target.device)
    header = [
        f"jaxvmm {jaxvmm.__version__} lifecycle latency: slot ops vs raw driver calls (medians of {iters} cycles)",
        f"device:      {target.device} ({target.device.device_kind}; native {backend} ordinal {ordinal})",
        f"backend:     {backend}" + ("" if on_gpu else "  (POSIX host backend: mmap/memfd/fallocate)"),
        f"driver:      {driver}",
        f"granularity: {human(gran)}",
        f"memory:      {free / GiB:,.1f} GiB free of {total / GiB:,.1f} GiB",
    ]
    print("\n".join(header), flush=True)

    rows: list[list[str]] = []
    for size in sizes:
        free, _ = jaxvmm.driver_memory_info(target.device)
        if size > 0.9 * free:
            notes.append(f"skipped {human(size)}: only {free / GiB:,.1f} GiB free")
            continue
        print(f"  measuring {human(size)} ...", file=sys.stderr, flush=True)
        try:
            native = hooks.bench_ops(backend, ordinal, size, iters)
            py = python_ops(target, size, iters)
        except jaxvmm.VmmError as e:
            notes.append(f"{human(size)} failed: {type(e).__name__}: {e}")
            continue
        rows += rows_for(size, native, py)

    notes.append("raw: reserve+create+map+access for create, unmap+release for release, create+map+access for "
                 "remap, address free for close (both close columns tear down an already-released slot).")
    notes.append("python: the same cycle driven through jaxvmm.Slot from Python (median, measured after the native run).")
    notes.append(f"goal: slot/raw <= {GOAL}x; 'raw <call>' rows are single driver calls, for reference.")
    table = render_table(rows, args.markdown) if rows else "(no sizes measured)"
    emit(header, table, notes, args.markdown, args.out)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
