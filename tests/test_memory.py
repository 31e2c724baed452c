"""Memory measurement: the device-memory timeline (jaxvmm.memory_timeline), pinned host usage and its
resettable peaks (jaxvmm.host_stats / reset_peaks) and the device ballast (jaxvmm.Ballast, GPU only)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxvmm

from conftest import jdev, run_in_subprocess

MiB = 1 << 20


def _wait():
    jaxvmm.synchronize()


# ---------------------------------------------------------------- timeline


def test_timeline_sees_a_slot_mapped_and_released(platform_device):
    n = 8 * MiB
    with jaxvmm.memory_timeline(platform_device, interval_us=100) as tl:
        s = jaxvmm.Slot(n, device=platform_device)
        time.sleep(0.03)
        s.release()
        time.sleep(0.03)
    s.close()
    assert tl.errors == 0
    assert tl.samples_taken > 20, tl.samples_taken  # ~60 ms at 100 us (sleep granularity: far fewer than 600)
    assert tl.peak_used_bytes - tl.first_used_bytes >= n * (0.9 if platform_device != "cpu" else 1)
    if platform_device == "cpu":
        assert tl.mapped_at_peak_bytes >= n  # the slot's pages were mapped at the moment of the peak
    # (On a GPU the driver's used figure also moves for reasons of its own, so its peak sample may
    # come after the release: the series must still have seen the pages mapped.)
    assert tl.series()[:, 2].max() - tl.series()[0, 2] >= n
    assert tl.internal_at_peak_bytes == 0  # a user slot, not staging
    ser = tl.series()
    assert ser.shape == (tl.samples_taken, 4)
    assert np.all(np.diff(ser[:, 0]) > 0)  # time moves forward
    assert ser[-1, 2] == ser[0, 2]  # the last sample (at stop) sees the pages gone again
    if platform_device == "cpu":
        assert tl.total_bytes == 0
        assert np.array_equal(ser[:, 1], ser[:, 2])  # POSIX: used is jaxvmm's mapped bytes and nothing else
    else:
        assert tl.total_bytes > 0


def test_timeline_ring_wraps_and_the_peak_survives():
    n = 4 * MiB
    with jaxvmm.memory_timeline("cpu", interval_us=50, capacity=16) as tl:
        s = jaxvmm.Slot(n, device="cpu")
        time.sleep(0.01)
        s.close()
        time.sleep(0.05)  # hundreds of samples after the slot closed: it falls out of the ring
    assert tl.samples_taken > 16
    ser = tl.series()
    assert ser.shape == (16, 4)
    assert np.all(np.diff(ser[:, 0]) > 0)
    assert ser[:, 1].max() < n  # the ring kept only the newest samples...
    assert tl.peak_used_bytes - tl.first_used_bytes >= n  # ...but the peak covers every sample taken
    assert tl.peak.t_s > 0


def test_timeline_live_read_and_validation():
    with pytest.raises(ValueError, match="interval_us"):
        jaxvmm.MemoryTimeline("cpu", interval_us=0)
    with pytest.raises(ValueError, match="capacity"):
        jaxvmm.MemoryTimeline("cpu", capacity=0)
    tl = jaxvmm.MemoryTimeline("cpu").start()
    time.sleep(0.01)
    assert tl.samples_taken >= 1 and tl.series().shape[1] == 4  # readable while running
    with pytest.raises(RuntimeError, match="already started"):
        tl.start()
    tl.stop()
    taken = tl.samples_taken
    time.sleep(0.01)
    assert tl.samples_taken == taken  # stopped: nothing more is recorded
    tl.stop()  # idempotent


def test_timeline_sees_staging_cells_as_internal():
    x = jnp.arange(1 << 18, dtype=jnp.float32, device=jdev("cpu"))  # 1 MiB
    jaxvmm.trim()
    with jaxvmm.memory_timeline("cpu") as tl:
        t = jaxvmm.offload(x)
        _wait()
        time.sleep(0.005)
        y = jaxvmm.reload(t)
        _wait()
    assert np.array_equal(np.asarray(y), np.asarray(x))
    assert tl.peak_mapped_bytes >= x.nbytes  # the staging cell the copy went through
    assert tl.series()[:, 3].max() >= x.nbytes  # counted as jaxvmm's own (internal) pages
    jaxvmm.trim()


# ---------------------------------------------------------------- pinned host usage


def test_host_stats_follow_offload_reload_free_and_reset():
    nbytes = 1 * MiB  # a multiple of the pool's 4 KiB blocks: in-use moves by exactly this much
    x = jnp.arange(nbytes // 4, dtype=jnp.float32, device=jdev("cpu"))
    _wait()
    jaxvmm.reset_peaks()
    h0 = jaxvmm.host_stats()
    assert h0["window_peak_in_use_bytes"] == h0["in_use_bytes"]

    t = jaxvmm.offload(x)
    _wait()
    h1 = jaxvmm.host_stats()
    assert h1["in_use_bytes"] - h0["in_use_bytes"] == nbytes
    assert h1["window_peak_in_use_bytes"] == h1["in_use_bytes"]
    assert h1["peak_in_use_bytes"] >= h1["in_use_bytes"]
    assert jaxvmm.stats()["host"]["in_use_bytes"] == h1["in_use_bytes"]  # the same numbers in stats()

    y = jaxvmm.reload(t)
    _wait()
    assert np.array_equal(np.asarray(y), np.asarray(x))
    h2 = jaxvmm.host_stats()
    assert h2["in_use_bytes"] == h0["in_use_bytes"]  # the reload consumed the ticket: its block is free
    assert h2["window_peak_in_use_bytes"] == h1["in_use_bytes"]  # the window still holds the step's peak

    jaxvmm.reset_peaks()
    h3 = jaxvmm.host_stats()
    assert h3["window_peak_in_use_bytes"] == h3["in_use_bytes"] == h0["in_use_bytes"]
    assert h3["peak_in_use_bytes"] >= h1["in_use_bytes"]  # the peak since start is kept

    # A ticket dropped without a reload frees its block too.
    t2 = jaxvmm.offload(x)
    _wait()
    assert jaxvmm.host_stats()["in_use_bytes"] - h0["in_use_bytes"] == nbytes
    del t2
    jaxvmm.collect()
    _wait()
    h4 = jaxvmm.host_stats()
    assert h4["in_use_bytes"] == h0["in_use_bytes"]
    assert h4["window_peak_in_use_bytes"] == h0["in_use_bytes"] + nbytes


def test_reset_peaks_restarts_the_staging_window():
    x = jnp.arange(1 << 18, dtype=jnp.float32, device=jdev("cpu"))
    y = jaxvmm.reload(jaxvmm.offload(x))
    _wait()
    assert np.array_equal(np.asarray(y), np.asarray(x))
    st = jaxvmm.engine_stats()["cpu:0"]
    assert st["staging_window_peak_bytes"] >= x.nbytes
    jaxvmm.trim()
    jaxvmm.reset_peaks()
    st = jaxvmm.engine_stats()["cpu:0"]
    assert st["staging_window_peak_bytes"] == st["staging_mapped_bytes"] == 0
    assert st["staging_peak_bytes"] >= x.nbytes  # since start: kept
    assert jaxvmm.host_stats()["staging_window_peak_bytes"] == 0


def test_host_stats_count_the_host_numa_store():
    """With host_store="host_numa" the offloaded bytes live in HOST_NUMA pages, not in the pinned pool:
    host_stats() counts them all the same (in use now, window peak)."""
    nbytes = 1 * MiB
    x = jnp.arange(nbytes // 4, dtype=jnp.float32, device=jdev("cpu"))
    old = jaxvmm.configure()["host_store"]
    jaxvmm.configure(host_store="host_numa")
    try:
        _wait()
        jaxvmm.reset_peaks()
        h0 = jaxvmm.host_stats()
        t = jaxvmm.offload(x)
        _wait()
        h1 = jaxvmm.host_stats()
        assert h1["in_use_bytes"] - h0["in_use_bytes"] == nbytes
        assert h1["window_peak_in_use_bytes"] - h0["window_peak_in_use_bytes"] == nbytes
        assert h1["host_numa_bytes"] >= nbytes
        assert np.array_equal(np.asarray(jaxvmm.reload(t)), np.asarray(x))
        _wait()
        assert jaxvmm.host_stats()["in_use_bytes"] == h0["in_use_bytes"]
    finally:
        jaxvmm.configure(host_store=old)


def test_host_stats_in_a_jitted_training_step_is_one_steps_worth():
    """Per-step window peak in a jitted step: the offloaded bytes of one step, and back to zero in use
    after each step (offloaded bytes never need more than one step's worth of host memory)."""
    def layer(x, w):
        from jax.ad_checkpoint import checkpoint_name
        h = checkpoint_name(jnp.tanh(x @ w), "h")
        return h @ w.T

    f = jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names("h"))

    def loss(ws, x):
        y, _ = jax.lax.scan(lambda c, w: (f(c, w), None), x, ws)
        return jnp.sum(y * y)

    step = jax.jit(jax.grad(loss))
    ws = jax.device_put(jnp.full((3, 256, 256), 0.01, jnp.float32), jdev("cpu"))
    x = jax.device_put(jnp.ones((256, 256), jnp.float32), jdev("cpu"))
    per_step = 3 * 256 * 256 * 4  # three layers' h
    jax.block_until_ready(step(ws, x))
    _wait()
    jaxvmm.collect()
    base = jaxvmm.host_stats()["in_use_bytes"]
    for _ in range(2):
        jaxvmm.reset_peaks()
        jax.block_until_ready(step(ws, x))
        _wait()
        h = jaxvmm.host_stats()
        assert h["window_peak_in_use_bytes"] - base == per_step, h
        assert h["in_use_bytes"] == base, h


# ---------------------------------------------------------------- GPU: platform allocator and ballast


@pytest.mark.gpu
def test_gpu_timeline_sees_xla_buffers_with_the_platform_allocator():
    r = run_in_subprocess("""
import time, jax, jax.numpy as jnp, jaxvmm
GiB = 1 << 30
with jaxvmm.memory_timeline("cuda:0") as tl:
    x = jnp.zeros((GiB // 4,), jnp.float32)   # 1 GiB through XLA's allocator
    x.block_until_ready()
    time.sleep(0.01)
    del x
    time.sleep(0.05)
ser = tl.series()
grew = tl.peak_used_bytes - tl.first_used_bytes
print("grew", grew, "end", int(ser[-1, 1]) - tl.first_used_bytes, "samples", tl.samples_taken)
assert tl.errors == 0
assert grew >= GiB, grew
assert int(ser[-1, 1]) - tl.first_used_bytes < GiB // 2   # the platform allocator returned it
print("OK")
""", env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.gpu
def test_gpu_ballast_leaves_the_budget_free_and_xla_hits_it():
    r = run_in_subprocess("""
import jaxvmm
GiB = 1 << 30
b = jaxvmm.Ballast(4 * GiB)          # before jax touches the GPU
assert b.nbytes > 0
assert abs(b.free_after_bytes - 4 * GiB) < 64 << 20, (b.free_after_bytes, b.nbytes)
import jax, jax.numpy as jnp
x = jnp.ones((GiB // 4,), jnp.float32); x.block_until_ready()   # 1 GiB fits
try:
    y = jnp.ones((5 * GiB // 4,), jnp.float32); y.block_until_ready()   # 5 GiB does not
    print("NO OOM")
except Exception as e:
    assert "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower(), e
    print("OOM as expected")
b.close()
assert b.nbytes == 0
print("OK")
""", env={"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, timeout=180)
    assert r.returncode == 0 and "OK" in r.stdout and "OOM as expected" in r.stdout, r.stdout + r.stderr
