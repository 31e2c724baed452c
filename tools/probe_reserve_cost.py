"""What pinning host memory costs in *device* memory (GPU): the driver's free device memory
(cuMemGetInfo, jax's context) before jaxvmm's engine exists, after it exists, and after
jaxvmm.reserve_host(N) for a few N.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 tools/probe_reserve_cost.py 1G 4G 14G
"""
import ctypes as C
import sys

import jax
import jax.numpy as jnp

import jaxvmm

cu = C.CDLL("libcuda.so.1")


def free_bytes() -> int:
    f, t = C.c_size_t(), C.c_size_t()
    assert cu.cuMemGetInfo_v2(C.byref(f), C.byref(t)) == 0
    return f.value


def main() -> int:
    jax.block_until_ready(jnp.ones(4))  # jax's context exists and is current on this thread's device
    dev = C.c_int()
    ctx = C.c_void_p()
    assert cu.cuDeviceGet(C.byref(dev), 0) == 0 and cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev) == 0
    assert cu.cuCtxSetCurrent(ctx) == 0
    base = free_bytes()
    x = jnp.ones((1024,), jnp.float32)
    jax.block_until_ready(jaxvmm.reload(jaxvmm.offload(x)))  # the engine exists
    jaxvmm.synchronize()
    eng = free_bytes()
    print(f"engine: {(base - eng) / 2**20:.1f} MiB of device memory")
    done = 0
    for arg in sys.argv[1:]:
        n = jaxvmm._config.parse_size(arg, "size")
        jaxvmm.reserve_host(n - done)
        done = n
        now = free_bytes()
        print(f"reserve_host to {arg}: {(eng - now) / 2**20:.1f} MiB of device memory since the engine "
              f"(pinned {jaxvmm.host_stats()['pinned_bytes'] / 2**30 if 'pinned_bytes' in jaxvmm.host_stats() else -1:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
