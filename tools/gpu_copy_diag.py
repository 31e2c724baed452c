"""Where does pinned-copy bandwidth go when the destination is a VMM slot? (GPU diagnostic, not a test.)

    python3 tools/gpu_copy_diag.py [SIZE_MiB] [ITERS]

Copies SIZE bytes ITERS times host<->device with CuPy on streams of their own, timed with CUDA events,
into or out of:
  malloc      a cudaMalloc buffer (the raw baseline)
  slot        two jaxvmm slots, mapped once, used alternately
  churn       two slots; before slot s is used again, the host waits for its last copy, then
              release() + remap() it (fresh pages every copy, the driver work overlapping the other copy)
  handoff     like churn, but only the driver's unmap/map of the same pages is skipped: pages stay mapped
              and the host still waits (isolates the host wait from the driver calls)
and both directions at once for malloc and churn. Prints GB/s per case.
"""
import sys
import threading
import time

import cupy as cp
import jax

import jaxvmm

MiB = 1 << 20
size = int(sys.argv[1]) * MiB if len(sys.argv) > 1 else 1024 * MiB
iters = int(sys.argv[2]) if len(sys.argv) > 2 else 10
jax.devices()
cp.cuda.Device(0).use()

H2D, D2H = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
pin_a = cp.cuda.alloc_pinned_memory(size)
pin_b = cp.cuda.alloc_pinned_memory(size)
dev_a = cp.cuda.alloc(size)
dev_b = cp.cuda.alloc(size)
slots = [jaxvmm.Slot(size, device=0) for _ in range(4)]


def run(direction, dsts, churn, wait):
    """GB/s of `iters` copies on one stream, cycling over `dsts` (device pointers or slots)."""
    stream = cp.cuda.Stream(non_blocking=True)
    done = [None] * len(dsts)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.Device().synchronize()
    start.record(stream)
    t0 = time.perf_counter()
    for i in range(iters):
        k = i % len(dsts)
        d = dsts[k]
        if isinstance(d, jaxvmm.Slot):
            if done[k] is not None and wait:
                done[k].synchronize()
            if churn and done[k] is not None:
                d.release()
                d.remap()
            ptr = d.address
        else:
            ptr = d
        host = pin_a.ptr if direction == "h2d" else pin_b.ptr
        if direction == "h2d":
            cp.cuda.runtime.memcpyAsync(ptr, host, size, H2D, stream.ptr)
        else:
            cp.cuda.runtime.memcpyAsync(host, ptr, size, D2H, stream.ptr)
        ev = cp.cuda.Event()
        ev.record(stream)
        done[k] = ev
    end.record(stream)
    end.synchronize()
    wall = time.perf_counter() - t0
    ms = cp.cuda.get_elapsed_time(start, end)
    return size * iters / (ms / 1e3) / 1e9, size * iters / wall / 1e9


def both(dsts_h2d, dsts_d2h, churn):
    res = {}
    ths = [threading.Thread(target=lambda k, d: res.__setitem__(k, run(k, d, churn, True)), args=a)
           for a in (("h2d", dsts_h2d), ("d2h", dsts_d2h))]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return 2 * size * iters / (time.perf_counter() - t0) / 1e9


print(f"size {size / MiB:.0f} MiB, {iters} copies per case (GB/s by events / by wall clock)")
for direction in ("h2d", "d2h"):
    run(direction, [dev_a.ptr], False, False)  # warm-up
    cases = {
        "malloc": ([dev_a.ptr, dev_b.ptr], False, False),
        "slot": (slots[:2], False, False),
        "slot+wait": (slots[:2], False, True),
        "churn": (slots[:2], True, True),
        "churn x3": (slots[:3], True, True),
    }
    for name, (dsts, churn, wait) in cases.items():
        ev, wall = run(direction, dsts, churn, wait)
        print(f"  {direction} {name:10s} {ev:6.1f} / {wall:6.1f}")
print(f"  both malloc      {both([dev_a.ptr], [dev_b.ptr], False):6.1f} (wall)")
print(f"  both slot        {both(slots[:2], slots[2:], False):6.1f} (wall)")
print(f"  both churn       {both(slots[:2], slots[2:], True):6.1f} (wall)")
for s in slots:
    s.close()
