"""What each step of a graph-mode round costs on the device (GPU only; no jax, no jaxvmm): kernels of
round_pieces.cu (PTX next to this file, tools/micro/round_pieces.ptx, made with
`nvcc -ptx -arch=compute_80 -O3`), each recorded 64 times in a row into one CUDA graph through
libcuda (ctypes), replayed; prints the median time per node.

    python3 tools/micro/round_pieces.py [--reps 40]
"""
import argparse
import ctypes as C
import os
import statistics

cu = C.CDLL("libcuda.so.1")
u64 = C.c_uint64


def ck(r, what):
    if r:
        raise RuntimeError(f"{what}: CUresult {r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--nodes", type=int, default=64)
    args = ap.parse_args()
    ck(cu.cuInit(0), "init")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
    ctx = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "ctx")
    ck(cu.cuCtxSetCurrent(ctx), "setctx")
    ptx = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "round_pieces.ptx"), "rb").read() + b"\0"
    mod = C.c_void_p()
    ck(cu.cuModuleLoadData(C.byref(mod), ptx), "module")
    fns = {}
    for name in ("k_empty", "k_copy", "k_take", "k_fused"):
        f = C.c_void_p()
        ck(cu.cuModuleGetFunction(C.byref(f), mod, name.encode()), name)
        fns[name] = f
    cu.cuMemAlloc_v2.argtypes = [C.POINTER(u64), C.c_size_t]
    cu.cuMemcpyDtoDAsync_v2.argtypes = [u64, u64, C.c_size_t, C.c_void_p]
    cu.cuMemsetD8_v2.argtypes = [u64, C.c_ubyte, C.c_size_t]
    big = 8 << 20
    src, dst, words = u64(), u64(), u64()
    ck(cu.cuMemAlloc_v2(C.byref(src), big), "alloc")
    ck(cu.cuMemAlloc_v2(C.byref(dst), big), "alloc")
    ck(cu.cuMemAlloc_v2(C.byref(words), 4096), "alloc")
    ck(cu.cuMemsetD8_v2(words, 0, 4096), "memset")
    flag = C.c_void_p()
    ck(cu.cuMemHostAlloc(C.byref(flag), 4096, 0x2), "hostalloc")
    stream = C.c_void_p()
    ck(cu.cuStreamCreate(C.byref(stream), 1), "stream")
    e0, e1 = C.c_void_p(), C.c_void_p()
    ck(cu.cuEventCreate(C.byref(e0), 0), "ev")
    ck(cu.cuEventCreate(C.byref(e1), 0), "ev")

    def launch(fn, grid, block, *a):
        vals = list(a)
        kp = (C.c_void_p * len(vals))(*[C.cast(C.pointer(v), C.c_void_p) for v in vals])
        ck(cu.cuLaunchKernel(fns[fn], grid, 1, 1, block, 1, 1, 0, stream, kp, None), fn)

    def graph_of(record):
        ck(cu.cuStreamBeginCapture_v2(stream, 2), "capture")
        for _ in range(args.nodes):
            record()
        g = C.c_void_p()
        ck(cu.cuStreamEndCapture(stream, C.byref(g)), "endcapture")
        exe = C.c_void_p()
        ck(cu.cuGraphInstantiateWithFlags(C.byref(exe), g, C.c_ulonglong(0)), "instantiate")
        return exe

    def time_graph(exe):
        for _ in range(3):
            ck(cu.cuGraphLaunch(exe, stream), "launch")
        ck(cu.cuStreamSynchronize(stream), "sync")
        ts = []
        for _ in range(args.reps):
            ck(cu.cuEventRecord(e0, stream), "rec")
            ck(cu.cuGraphLaunch(exe, stream), "launch")
            ck(cu.cuEventRecord(e1, stream), "rec")
            ck(cu.cuEventSynchronize(e1), "evsync")
            ms = C.c_float()
            ck(cu.cuEventElapsedTime(C.byref(ms), e0, e1), "elapsed")
            ts.append(ms.value * 1e3 / args.nodes)
        return statistics.median(ts)

    fl = u64(flag.value)
    rows = []
    for n, blocks in ((1 << 20, 64), (4 << 20, 128)):
        N = u64(n)
        cases = {
            "empty kernel (1 thread)": lambda: launch("k_empty", 1, 1),
            "driver memcpy node (D2D)": lambda: ck(cu.cuMemcpyDtoDAsync_v2(dst.value, src.value, n, stream), "memcpy"),
            "copy only": lambda: launch("k_copy", blocks, 256, words, src, dst, N, fl, C.c_int(0)),
            "copy + count blocks": lambda: launch("k_copy", blocks, 256, words, src, dst, N, fl, C.c_int(1)),
            "copy + count + publish (gpu fence)": lambda: launch("k_copy", blocks, 256, words, src, dst, N, fl, C.c_int(2)),
            "copy + count + publish (sys fences) [round's copy]": lambda: launch("k_copy", blocks, 256, words, src, dst, N, fl, C.c_int(3)),
            "take kernel (1 thread)": lambda: launch("k_take", 1, 1, words, dst),
            "take + copy (two nodes)": lambda: (launch("k_take", 1, 1, words, dst),
                                               launch("k_copy", blocks, 256, words, src, dst, N, fl, C.c_int(3))),
            "fused: arrive-elected taker [today]": lambda: launch("k_fused", blocks, 256, words, src, dst, N, fl, C.c_int(3), C.c_int(0)),
            "fused: block 0 takes": lambda: launch("k_fused", blocks, 256, words, src, dst, N, fl, C.c_int(3), C.c_int(2)),
            "fused: no handshake": lambda: launch("k_fused", blocks, 256, words, src, dst, N, fl, C.c_int(3), C.c_int(3)),
            "fused: arrive-elected, count only": lambda: launch("k_fused", blocks, 256, words, src, dst, N, fl, C.c_int(1), C.c_int(0)),
        }
        for name, rec in cases.items():
            rows.append((n >> 20, name, time_graph(graph_of(rec))))
    print(f"| MiB | node ({args.nodes} in a row in one graph) | us per node |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} |")


if __name__ == "__main__":
    main()
