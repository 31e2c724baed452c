"""Does cuMemHostAlloc return while (a) a stream is blocked on a device-side wait, (b) a kernel-free
stream waits and device memory is full, (c) both? Prints the time of each call (a hang = timeout)."""
import ctypes, threading, time, sys
from cuda.bindings import driver as cu

def ck(r):
    err = r[0] if isinstance(r, tuple) else r
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(str(err))
    return r[1] if isinstance(r, tuple) and len(r) == 2 else (r[1:] if isinstance(r, tuple) else None)

ck(cu.cuInit(0)); dev = ck(cu.cuDeviceGet(0)); ctx = ck(cu.cuDevicePrimaryCtxRetain(dev)); ck(cu.cuCtxSetCurrent(ctx))
flag = ck(cu.cuMemHostAlloc(8, cu.CU_MEMHOSTALLOC_DEVICEMAP))
ctypes.c_uint64.from_address(int(flag)).value = 0
dflag = ck(cu.cuMemHostGetDevicePointer(flag, 0))
s = ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

def timed(what, fn, limit=20.0):
    box = {}
    def go():
        ck(cu.cuCtxSetCurrent(ctx)); t = time.perf_counter(); box["r"] = fn(); box["t"] = time.perf_counter() - t
    th = threading.Thread(target=go, daemon=True); th.start(); th.join(limit)
    print(f"{what}: " + (f"{box['t']*1e3:.1f} ms" if "t" in box else f"HUNG > {limit} s"), flush=True)
    return box.get("r")

def blocked_stream(big):
    ctypes.c_uint64.from_address(int(flag)).value = 0
    ck(cu.cuStreamWaitValue32(s, dflag, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ))
    d = ck(cu.cuMemAlloc(big)) ; ck(cu.cuMemsetD8Async(d, 1, big, s))
    return d

timed("hostalloc 256 MiB, idle", lambda: ck(cu.cuMemHostAlloc(256 << 20, 0)))
d = blocked_stream(1 << 30)
timed("hostalloc 256 MiB, stream blocked on a wait value", lambda: ck(cu.cuMemHostAlloc(256 << 20, 0)))
timed("cuMemAlloc 64 MiB, stream blocked", lambda: ck(cu.cuMemAlloc(64 << 20)))
timed("cuMemFree, stream blocked", lambda: ck(cu.cuMemFree(d)), 5)
ctypes.c_uint64.from_address(int(flag)).value = 1
ck(cu.cuStreamSynchronize(s)); print("stream released", flush=True)
# device memory full
held = []
free, total = ck(cu.cuMemGetInfo())
while True:
    r = cu.cuMemAlloc(1 << 30)
    if r[0] != cu.CUresult.CUDA_SUCCESS: break
    held.append(r[1])
while True:
    r = cu.cuMemAlloc(16 << 20)
    if r[0] != cu.CUresult.CUDA_SUCCESS: break
    held.append(r[1])
print("device full: free", ck(cu.cuMemGetInfo())[0] >> 20, "MiB", flush=True)
timed("hostalloc 256 MiB, device full", lambda: cu.cuMemHostAlloc(256 << 20, 0)[0])
timed("hostalloc 1 GiB, device full", lambda: cu.cuMemHostAlloc(1 << 30, 0)[0])
ctypes.c_uint64.from_address(int(flag)).value = 0
ck(cu.cuStreamWaitValue32(s, dflag, 1, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ))
timed("hostalloc 256 MiB, device full + stream blocked", lambda: cu.cuMemHostAlloc(256 << 20, 0)[0])
ctypes.c_uint64.from_address(int(flag)).value = 1
ck(cu.cuStreamSynchronize(s)); print("done", flush=True)
sys.stdout.flush(); import os; os._exit(0)
