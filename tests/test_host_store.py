"""The host store (where offloaded bytes live on the host: ``pinned`` or ``host_numa``) and the staging
pools per direction (a reload's copy never waits for an unrelated offload's cell, nor the reverse).

On the jax ``cpu`` platform the host_numa store maps its chunks with the POSIX implementation of the VMM
calls (the same as slots'), so everything but the real driver's HOST_NUMA pages runs here. Each test that
switches the store runs in a subprocess: the store is process-wide, and a host_numa chunk's VA range stays
reserved (and counted by the driver seam) until the engine shuts down.
"""

from __future__ import annotations

import textwrap

import pytest

import jaxvmm
import jaxvmm.testing

from conftest import run_in_subprocess

ENV = {"JAX_PLATFORMS": "cpu"}


def _run(body: str, env: dict | None = None, device: str = "cpu", prelude: bool = True):
    """Runs PRELUDE (with DEV the device's stats key) and then ``body`` in a fresh interpreter."""
    code = (PRELUDE.replace("DEV", repr(f"{device}:0")) if prelude else "") + textwrap.dedent(body)
    r = run_in_subprocess(code, env={**ENV, **(env or {})} if device == "cpu" else env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    return r


PRELUDE = """
import jax, jax.numpy as jnp, numpy as np, jaxvmm
from jaxvmm import testing
st = lambda: jaxvmm.engine_stats()[DEV]
def bits(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    return jax.device_put(jnp.asarray(raw.view(dtype).reshape(shape)), jax.devices()[0])
def same(a, b):  # bytes, not values: random bits hold NaNs
    return np.asarray(a).dtype == np.asarray(b).dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
"""


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_numa_offload_reload_is_bit_exact_subprocess(platform):
    code = """
    try:
        jaxvmm.configure(host_store="host_numa")
        xs = [bits(s, d, i) for i, (s, d) in enumerate([((3, 1001), np.float32), ((4097,), np.int8),
                                                        ((257, 129), np.uint16), ((1 << 20,), np.float32)])]
        ts = [jaxvmm.offload(x) for x in xs]                      # eager
        jaxvmm.synchronize()
        s = st()
        assert s["host_store"] == "host_numa" and s["host_numa_in_use_bytes"] >= sum(x.nbytes for x in xs), s
        assert s["pinned_in_use_bytes"] == 0 and s["host_store_bytes"] == s["host_numa_bytes"] > 0, s
        for x, t in zip(xs, ts):
            assert same(jaxvmm.reload(t), x)
        del ts
        both = jax.jit(lambda x, t: (jaxvmm.offload(x), jaxvmm.reload(t)))  # both directions in one program
        t = jax.jit(jaxvmm.offload)(xs[3])
        for i in range(4):
            t, y = both(xs[3], t)
            assert same(y, xs[3]), i
        assert same(jax.jit(jaxvmm.reload)(t), xs[3])
        del t, y
        jaxvmm.synchronize()
        s = st()
        assert s["host_numa_in_use_bytes"] == 0 and s["tickets_live"] == 0 and s["errors"] == 0, s
        assert s["pinned_bytes"] == 0, s   # nothing came from the pinned pool
    except jaxvmm.NotSupportedError as e:
        print("SKIP", e)
    print("OK")
    """
    r = _run(code, device=platform)
    if "SKIP" in r.stdout:
        pytest.skip(r.stdout.strip().splitlines()[-2])


def test_host_numa_memory_goes_back_on_free_and_trim_subprocess():
    code = """
    jaxvmm.configure(host_store="host_numa")
    testing.configure_debug(host_pool_chunk="4M")
    base = testing.driver_counters()
    x = bits((1 << 18,), np.float32, 1)   # 1 MiB
    ts = [jaxvmm.offload(x) for _ in range(3)]
    jaxvmm.synchronize()
    s = st()
    assert s["host_numa_in_use_bytes"] == 3 << 20 and s["host_numa_bytes"] == 4 << 20 and s["host_numa_allocs"] == 1, s
    assert same(jaxvmm.reload(ts[0]), x)
    del ts                                  # freed: back to the store, still held by it
    jaxvmm.synchronize()
    s = st()
    assert s["host_numa_in_use_bytes"] == 0 and s["host_numa_bytes"] == 4 << 20, s
    assert jaxvmm.trim() >= 4 << 20         # trimmed: the pages go back, the VA range stays reserved
    s = st()
    assert s["host_numa_bytes"] == 0 and s["host_numa_frees"] == 1, s
    c = testing.driver_counters()
    assert c["live_mappings"] == base["live_mappings"] and c["live_handles"] == base["live_handles"], (c, base)
    reserved = c["live_reservations"]
    t = jaxvmm.offload(x)                   # grows again at the same VA: no new reservation
    assert same(jaxvmm.reload(t), x)
    jaxvmm.synchronize()
    assert st()["host_numa_allocs"] == 2, st()
    assert testing.driver_counters()["live_reservations"] <= reserved + 1, testing.driver_counters()  # + a staging cell
    print("OK")
    """
    _run(code)


def test_switching_stores_while_tickets_live_subprocess():
    code = """
    x, z = bits((5000,), np.float32, 2), bits((5000,), np.float32, 3)
    tp = jaxvmm.offload(x)                          # pinned (the default)
    assert jaxvmm.configure(host_store="host_numa")["host_store"] == "host_numa"
    tn = jaxvmm.offload(z)                          # host_numa
    jaxvmm.synchronize()
    s = st()
    assert s["pinned_in_use_bytes"] > 0 and s["host_numa_in_use_bytes"] > 0, s
    jaxvmm.configure(host_store="pinned")
    assert same(jaxvmm.reload(tn), z) and same(jaxvmm.reload(tp), x)
    del tp, tn
    jaxvmm.synchronize()
    s = st()
    assert s["pinned_in_use_bytes"] == 0 and s["host_numa_in_use_bytes"] == 0 and s["host_store"] == "pinned", s
    print("OK")
    """
    _run(code)


def test_host_numa_creation_failure_is_an_error_at_the_call_subprocess():
    code = """
    jaxvmm.configure(host_store="host_numa")
    x = bits((3000,), np.float32, 4)
    with testing.fault("cuMemCreate", error="CUDA_ERROR_NOT_SUPPORTED"):
        try:
            jaxvmm.offload(x)
            raise SystemExit("offload succeeded without host pages")
        except jaxvmm.VmmError as e:
            assert str(e).startswith("jaxvmm:") and "cuMemCreate" in str(e), e
    s = st()
    assert s["tickets_live"] == 0 and s["host_numa_bytes"] == 0, s
    assert testing.driver_counters()["live_mappings"] == 0, testing.driver_counters()
    t = jaxvmm.offload(x)                            # the next one works
    assert same(jaxvmm.reload(t), x)
    print("OK")
    """
    _run(code)


def test_host_store_environment_variable_subprocess():
    r = _run("import jaxvmm\nassert jaxvmm.configure()['host_store'] == 'host_numa', jaxvmm.configure()\nprint('OK')",
             env={"JAXVMM_HOST_STORE": "HOST_NUMA"}, prelude=False)
    assert r.returncode == 0


@pytest.mark.parametrize("value,exc", [("gpu", jaxvmm.InvalidArgumentError), ("", jaxvmm.InvalidArgumentError),
                                       (1, jaxvmm.errors.InvalidArgumentTypeError),
                                       (b"pinned", jaxvmm.errors.InvalidArgumentTypeError)])
def test_configure_host_store_validation(value, exc):
    before = jaxvmm.configure()
    with pytest.raises(exc, match="configure: host_store"):
        jaxvmm.configure(host_store=value)
    assert jaxvmm.configure() == before


def test_staging_pools_are_per_direction_subprocess():
    # The GPU is "behind" (every cuEventQuery says NOT_READY): no offload cell is ever seen finished. Two
    # offloads fill the offload pool (depth 2); the reloads that follow must map a cell of their own
    # rather than make h2d wait for those offloads' D2H (before: they took the offload cells, a device
    # wait each).
    # A third offload then waits for its own pool's oldest cell, never a reload's.
    code = """
    jaxvmm.configure(prefetch_depth=2, staging_idle_ms=600000)
    x = bits((1 << 18,), np.float32, 5)
    t0 = jaxvmm.offload(x); jaxvmm.synchronize()
    del t0; jaxvmm.synchronize(); jaxvmm.trim()     # warm: the engine exists, no cell is mapped
    # (No synchronize() while the fault is armed, and reloads in the order the engine predicts: the op
    # ring's workers poll the same events, so to them the ops never complete either and a misprediction
    # would never be corrected. On cpu the handlers' stream work is done when they return.)
    testing.arm_fault("cuEventQuery", times=-1, error="CUDA_ERROR_NOT_READY")
    try:
        s0 = st()
        a, b = jaxvmm.offload(x), jaxvmm.offload(x)
        yb, ya = jaxvmm.reload(b), jaxvmm.reload(a)
        s1 = st()
        # (On cpu XLA's stream is null: a reload cell's free event is never recorded, so the second
        # reload reuses the first one's cell without a wait; on a GPU it would map a second one.)
        assert s1["staging_offload_cells"] == 2 and s1["staging_reload_cells"] == 1, s1
        assert s1["staging_device_waits"] - s0["staging_device_waits"] == 0, (s0, s1)
        c = jaxvmm.offload(x)
        s2 = st()
        assert s2["staging_device_waits"] - s1["staging_device_waits"] == 1, s2          # its own pool's oldest
        assert s2["staging_offload_cells"] == 2 and s2["staging_reload_cells"] == 1, s2
    finally:
        testing.clear_faults()
    assert same(ya, x) and same(yb, x)
    assert same(jaxvmm.reload(c), x)
    print("OK")
    """
    _run(code)


def test_finished_cells_move_between_pools_subprocess():
    # With every copy done (the cpu backend), a reload takes the idle offload cell instead of mapping
    # another: per-direction pools cost no memory when the directions take turns.
    code = """
    jaxvmm.configure(staging_idle_ms=600000)   # no idle return between the calls
    x = bits((1 << 18,), np.float32, 6)
    for _ in range(3):
        t = jaxvmm.offload(x)
        assert same(jaxvmm.reload(t), x)
    jaxvmm.synchronize()
    s = st()
    assert s["staging_cells"] == 1 and s["staging_pages_mapped"] == 1, s
    print("OK")
    """
    _run(code)


def test_copies_go_in_pieces_subprocess():
    # copy_chunk splits each D2H/H2D between a cell and a host block into pieces (odd sizes: the offsets
    # must add up); the bytes are the same, the copies counted at the driver seam are ceil(n / chunk).
    code = """
    assert testing.configure_debug(copy_chunk=12345)["copy_chunk"] == 12345
    calls = lambda: testing.driver_counters()["calls"]
    x = bits((100003,), np.float32, 7)          # 400012 bytes: 33 pieces
    c0 = calls()
    t = jaxvmm.offload(x)
    jaxvmm.synchronize()
    c1 = calls()
    assert c1["cuMemcpyDtoHAsync"] - c0["cuMemcpyDtoHAsync"] == 33, (c0["cuMemcpyDtoHAsync"], c1["cuMemcpyDtoHAsync"])
    y = jaxvmm.reload(t)
    jaxvmm.synchronize()
    c2 = calls()
    assert c2["cuMemcpyHtoDAsync"] - c1["cuMemcpyHtoDAsync"] == 33, (c1["cuMemcpyHtoDAsync"], c2["cuMemcpyHtoDAsync"])
    assert same(y, x)
    jaxvmm.configure(host_store="host_numa")      # by unified address, in pieces too
    for chunk in (12345, 0, "1M"):
        testing.configure_debug(copy_chunk=chunk)
        assert same(jaxvmm.reload(jaxvmm.offload(x)), x), chunk
    assert testing.configure_debug()["copy_chunk"] == 1 << 20
    print("OK")
    """
    _run(code)


@pytest.mark.parametrize("value,exc", [(-1, jaxvmm.InvalidArgumentError), ("lots", jaxvmm.InvalidArgumentError),
                                       (1.5, jaxvmm.InvalidArgumentError)])
def test_configure_copy_chunk_validation(value, exc):
    before = jaxvmm.testing.configure_debug()
    with pytest.raises(exc, match="configure_debug: copy_chunk"):
        jaxvmm.testing.configure_debug(copy_chunk=value)
    assert jaxvmm.testing.configure_debug() == before


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_copies_in_odd_pieces_are_bit_exact_subprocess(platform):
    # Pieces at odd offsets (not page- or granule-aligned) on the real driver too, both stores, eager and
    # in one jitted program that offloads while it reloads.
    code = """
    x = bits((3, 1 << 20), np.float32, 8)      # 12 MiB: 13 pieces of 1000003 bytes
    both = jax.jit(lambda x, t: (jaxvmm.offload(x), jaxvmm.reload(t)))
    for store in ("pinned", "host_numa"):
        for chunk in (1000003, 0):
            try:
                jaxvmm.configure(host_store=store)
                testing.configure_debug(copy_chunk=chunk)
                t = jaxvmm.offload(x)
                assert same(jaxvmm.reload(t), x), (store, chunk)
                t = jax.jit(jaxvmm.offload)(x)
                for i in range(3):
                    t, y = both(x, t)
                    assert same(y, x), (store, chunk, i)
                assert same(jaxvmm.reload(t), x)
                del t, y
            except jaxvmm.NotSupportedError as e:
                assert store == "host_numa", e
                print("no host_numa:", e)
    jaxvmm.synchronize()
    s = st()
    assert s["errors"] == 0 and s["tickets_live"] == 0, s
    print("OK")
    """
    _run(code, device=platform)
