"""offload / reload / prefetch: values, transformations, engine accounting, lifetimes and bad input.

On the jax ``cpu`` platform the offload engine runs over the POSIX backend (streams are synchronous,
host functions run inline, the worker threads are the same), so everything except real GPU overlap and
driver memory is exercised here. Tests taking ``platform_device`` also run on ``cuda:0`` (gpu-marked,
skipped without a GPU); the ``gpu``-marked section at the end is GPU-only.
"""

from __future__ import annotations

import gc
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxvmm
import jaxvmm.testing
from jaxvmm._devices import target_of
from jaxvmm._native import lib

from conftest import dkey, drain_errors, jdev, run_in_subprocess

MiB = 1 << 20

# No size below is a multiple of the POSIX page (4 KiB) or of the CUDA granularity (2 MiB).
SHAPES = [(3, 1001), (7,), ()]


def _dtype_param(d):
    return pytest.param(d, id=np.dtype(d).name)


DTYPES = [_dtype_param(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.int32, jnp.bool_,
                                    jnp.uint16, jnp.complex64)]

ENGINE_ZERO = dict.fromkeys(
    ("offloads", "reloads", "prefetches", "prefetch_hits", "prefetch_misses", "tickets_live", "ticket_host_bytes",
     "errors", "drops", "ops_in_flight", "seq_issued", "seq_completed",
     "pinned_bytes", "pinned_in_use_bytes",
     "pinned_peak_in_use_bytes", "pinned_allocs"), 0)


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------
def estats(device="cpu") -> dict:
    """Engine stats of one device after synchronize(); zeros when its engine does not exist yet."""
    jaxvmm.synchronize()
    return {**ENGINE_ZERO, **jaxvmm.engine_stats().get(dkey(device), {})}


def mapped(device="cpu") -> int:
    """Mapped bytes of the device once idle staging pages went back (jaxvmm.trim())."""
    jaxvmm.trim()
    return jaxvmm.stats()["devices"].get(dkey(device), {}).get("mapped_bytes", 0)


def random_array(shape, dtype, seed=0) -> np.ndarray:
    """Random *bits* (NaN payloads, denormals, negative zero, every int) so that only a byte copy passes."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def put(x, device="cpu") -> jax.Array:
    return jax.device_put(x, jdev(device))


def assert_bits_equal(y, x) -> None:
    y = np.asarray(y)
    x = np.asarray(x)
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    assert np.ascontiguousarray(y).view(np.uint8).tobytes() == np.ascontiguousarray(x).view(np.uint8).tobytes()


def all_ff(y) -> bool:
    return bool((np.ascontiguousarray(np.asarray(y)).view(np.uint8) == 0xFF).all())


def ticket_id(ticket) -> int:
    """The number the engine's messages use for a ticket ("ticket 7"): the low word of its token."""
    return int(np.asarray(ticket.token).reshape(-1, 2)[0, 0])


_offload_jit = jax.jit(jaxvmm.offload)
_reload_jit = jax.jit(jaxvmm.reload)
_roundtrip_jit = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))


@pytest.fixture(autouse=True)
def _engine_hygiene():
    drain_errors(collect=False)
    yield
    drain_errors()


def subprocess_env(platform: str = "cpu") -> dict:
    # No preallocation: the parent test process may hold part of the GPU already.
    return {"JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def assert_clean_subprocess(r, expect_stdout: str = "OK") -> None:
    assert r.returncode == 0, f"rc={r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert expect_stdout in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert "leaked" not in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------------
# values: bit-exact round trips
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "jit", "across_jits"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_bit_exact(platform_device, dtype, shape, mode):
    x_np = random_array(shape, dtype, seed=hash((np.dtype(dtype).name, shape)) & 0xFFFF)
    x = put(x_np, platform_device)
    before = estats(platform_device)
    if mode == "eager":
        t = jaxvmm.offload(x)
        assert isinstance(t, jaxvmm.Ticket) and t.shape == tuple(shape) and t.dtype == np.dtype(dtype)
        assert t.nbytes == x_np.nbytes
        y = jaxvmm.reload(t)
    elif mode == "jit":
        y = _roundtrip_jit(x)
    else:  # the ticket is returned by one jitted call and consumed by another
        t = _offload_jit(x)
        assert isinstance(t, jaxvmm.Ticket) and t.shape == tuple(shape)
        y = _reload_jit(t)
    assert list(y.devices()) == [jdev(platform_device)]
    assert_bits_equal(y, x_np)
    after = estats(platform_device)
    assert after["offloads"] - before["offloads"] == 1
    assert after["reloads"] - before["reloads"] == 1
    assert after["errors"] == before["errors"]
    assert after["tickets_live"] == before["tickets_live"]
    jaxvmm.check()


def test_numpy_and_scalar_inputs_are_accepted():
    x = random_array((5, 3), np.float32, seed=1)
    assert_bits_equal(jaxvmm.reload(jaxvmm.offload(x)), x)
    s = np.int32(-7)
    assert_bits_equal(jaxvmm.reload(jaxvmm.offload(s)), np.asarray(s))


@pytest.mark.parametrize("order", ["lifo", "fifo", "shuffled", "interleaved"])
@pytest.mark.parametrize("where", ["eager", "jit"])
def test_reload_order_is_free(platform_device, order, where):
    """Same shape and dtype for every ticket, so a wrong guess of the engine's LIFO/FIFO predictor would
    hand back another ticket's data if its correction were broken."""
    n = 6
    xs = [put(random_array((3, 1001), np.float32, seed=100 + i), platform_device) for i in range(n)]
    before = estats(platform_device)
    tickets = jax.jit(lambda xs: [jaxvmm.offload(x) for x in xs])(xs)
    assert len({tuple(np.asarray(t.token)) for t in tickets}) == n
    perm = {"lifo": list(range(n))[::-1], "fifo": list(range(n)), "shuffled": [2, 5, 0, 3, 1, 4],
            "interleaved": [1, 0, 4, 5, 2, 3]}[order]
    if where == "eager":
        ys = [jaxvmm.reload(tickets[i]) for i in perm]
    else:
        ys = jax.jit(lambda ts: [jaxvmm.reload(t) for t in ts])([tickets[i] for i in perm])
    for i, y in zip(perm, ys):
        assert_bits_equal(y, np.asarray(xs[i]))
    jaxvmm.check()
    after = estats(platform_device)
    assert after["reloads"] - before["reloads"] == n
    assert (after["prefetch_hits"] + after["prefetch_misses"]) - (before["prefetch_hits"] + before["prefetch_misses"]) == n
    assert after["errors"] == before["errors"]
    assert after["tickets_live"] == before["tickets_live"]


def test_offloads_and_reloads_interleaved_in_one_jit(platform_device):
    a, b, c = (put(random_array((257,), np.int32, seed=s), platform_device) for s in (1, 2, 3))

    @jax.jit
    def f(a, b, c):
        ta = jaxvmm.offload(a)
        tb = jaxvmm.offload(b)
        yb = jaxvmm.reload(tb)
        tc = jaxvmm.offload(c)
        ya = jaxvmm.reload(ta)
        yc = jaxvmm.reload(tc)
        return ya, yb, yc

    for y, x in zip(f(a, b, c), (a, b, c)):
        assert_bits_equal(y, np.asarray(x))
    jaxvmm.check()


def test_mixed_shapes_and_dtypes_reverse_order(platform_device):
    xs = [put(random_array(s, d, seed=i), platform_device)
          for i, (s, d) in enumerate([((3, 1001), np.float32), ((3, 1001), np.int32), ((1001, 3), np.float32),
                                      ((12012,), np.int8), ((3, 1001), np.float32)])]
    tickets = _offload_jit_list(xs)
    ys = jax.jit(lambda ts: [jaxvmm.reload(t) for t in ts[::-1]])(tickets)
    for y, x in zip(ys, xs[::-1]):
        assert_bits_equal(y, np.asarray(x))
    jaxvmm.check()


_offload_jit_list = jax.jit(lambda xs: [jaxvmm.offload(x) for x in xs])


# ---------------------------------------------------------------------------------------------------
# values: inside lax.scan, custom_vjp, vmap
# ---------------------------------------------------------------------------------------------------
LAYERS = 8


def _scan_inputs(device):
    ws = put(np.random.default_rng(1).standard_normal((LAYERS, 64, 64)).astype(np.float32) * 0.1, device)
    h0 = put(np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32), device)
    return h0, ws


def _layer(h, w):
    return jnp.tanh(h @ w)


@jax.jit
def _forward_offloading(h, ws):
    """Offloads each layer's input; also returns the inputs themselves, as the reference (same program,
    so the comparison does not depend on two compilations rounding alike)."""

    def body(h, w):
        return _layer(h, w), (jaxvmm.offload(h), h)

    return lax.scan(body, h, ws)


def _reload_scan(ts, reverse):
    return lax.scan(lambda c, t: (c, jaxvmm.reload(t)), 0, ts, reverse=reverse)[1]


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_scan_over_layers_separate_jits(platform_device, direction):
    h0, ws = _scan_inputs(platform_device)
    before = estats(platform_device)
    hT, (tickets, expected) = _forward_offloading(h0, ws)
    jax.block_until_ready(tickets)
    assert isinstance(tickets, jaxvmm.Ticket)
    assert tickets.shape == (3, 64) and tickets.token.shape == (LAYERS, 2)
    mid = estats(platform_device)
    assert mid["tickets_live"] - before["tickets_live"] == LAYERS, (before, mid, tickets.token)
    assert len({tuple(r) for r in np.asarray(tickets.token)}) == LAYERS

    ys = jax.jit(_reload_scan, static_argnums=1)(tickets, direction == "reverse")
    assert_bits_equal(ys, np.asarray(expected))
    jaxvmm.check()
    after = estats(platform_device)
    assert after["offloads"] - before["offloads"] == LAYERS
    assert after["reloads"] - before["reloads"] == LAYERS
    assert after["tickets_live"] == before["tickets_live"]
    assert after["errors"] == before["errors"]


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_scan_forward_and_backward_in_one_jit(platform_device, direction):
    h0, ws = _scan_inputs(platform_device)

    @jax.jit
    def step(h, ws):
        hT, (ts, hs) = _forward_offloading(h, ws)
        return hs, _reload_scan(ts, direction == "reverse")

    for _ in range(3):  # repeated steps reuse the same executable and staging slots
        expected, ys = step(h0, ws)
        assert_bits_equal(ys, np.asarray(expected))
    jaxvmm.check()


def _make_layer(offload: bool):
    @jax.custom_vjp
    def layer(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (jaxvmm.offload(x) if offload else x, w, y)

    def bwd(res, g):
        x, w, y = res
        if offload:
            x = jaxvmm.reload(x)
        gy = g * (1 - y * y)
        return gy @ w.T, x.T @ gy

    layer.defvjp(fwd, bwd)
    return layer


def _loss(layer):
    def loss(x, w):
        for _ in range(3):
            x = layer(x, w)
        return (x * x).sum()

    return loss


def test_custom_vjp_residual_offload_matches_no_offload_under_jit(platform_device):
    rng = np.random.default_rng(3)
    x = put(rng.standard_normal((5, 33)).astype(np.float32), platform_device)
    w = put((rng.standard_normal((33, 33)) * 0.2).astype(np.float32), platform_device)
    before = estats(platform_device)
    g_off = jax.jit(jax.grad(_loss(_make_layer(True)), argnums=(0, 1)))(x, w)
    g_ref = jax.jit(jax.grad(_loss(_make_layer(False)), argnums=(0, 1)))(x, w)
    for a, b in zip(g_off, g_ref):  # two programs: allow for different rounding, nothing more
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(g_ref[1]).max()) > 0  # not vacuous
    jaxvmm.check()
    after = estats(platform_device)
    assert after["offloads"] - before["offloads"] == 3
    assert after["reloads"] - before["reloads"] == 3
    assert after["tickets_live"] == before["tickets_live"]


def test_custom_vjp_residual_offload_eager():
    """Outside jit the residual Ticket is flattened and rebuilt by JAX, and the original object dies
    before bwd runs: its ticket must survive that."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 33)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((33, 33)) * 0.2).astype(np.float32))
    g_off = jax.grad(_loss(_make_layer(True)), argnums=(0, 1))(x, w)
    g_ref = jax.grad(_loss(_make_layer(False)), argnums=(0, 1))(x, w)
    jaxvmm.check()
    for a, b in zip(g_off, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("where", ["eager", "jit"])
def test_vmap_roundtrip(platform_device, where):
    x_np = random_array((4, 3, 101), np.float32, seed=5)
    x = put(x_np, platform_device)
    before = estats(platform_device)
    f = jax.vmap(lambda v: jaxvmm.reload(jaxvmm.offload(v)))
    y = (jax.jit(f) if where == "jit" else f)(x)
    assert_bits_equal(y, x_np)
    jaxvmm.check()
    after = estats(platform_device)
    assert after["offloads"] - before["offloads"] == 4  # one ticket per batch element
    assert after["reloads"] - before["reloads"] == 4
    assert after["tickets_live"] == before["tickets_live"]


def test_vmap_each_batch_element_is_its_own_ticket(platform_device):
    x_np = random_array((5, 2, 300), np.int32, seed=6)
    x = put(x_np, platform_device)
    before = estats(platform_device)
    t = jax.vmap(jaxvmm.offload)(x)
    assert isinstance(t, jaxvmm.Ticket) and t.shape == (2, 300) and t.token.shape == (5, 2)
    tokens = np.asarray(t.token)
    assert len({tuple(r) for r in tokens}) == 5
    mid = estats(platform_device)
    assert mid["tickets_live"] - before["tickets_live"] == 5
    assert mid["ticket_host_bytes"] - before["ticket_host_bytes"] == x_np.nbytes
    y = jax.jit(jax.vmap(jaxvmm.reload))(t)
    assert_bits_equal(y, x_np)
    jaxvmm.check()
    assert estats(platform_device)["tickets_live"] == before["tickets_live"]


# ---------------------------------------------------------------------------------------------------
# differentiation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["grad", "jit_grad", "vjp", "jvp"])
def test_differentiating_through_offload_raises(how):
    x = jnp.arange(12.0).reshape(3, 4)

    def f(x):
        return (jaxvmm.reload(jaxvmm.offload(x)) ** 2).sum()

    with pytest.raises(TypeError, match=r"jaxvmm\.checkpoint"):
        if how == "grad":
            jax.grad(f)(x)
        elif how == "jit_grad":
            jax.jit(jax.grad(f))(x)
        elif how == "vjp":
            jax.vjp(f, x)
        else:
            jax.jvp(f, (x,), (jnp.ones_like(x),))
    # the failed trace must not have left engine work or tickets behind
    drain_errors()
    jaxvmm.check()


def test_stop_gradient_before_offload_is_allowed():
    x = jnp.arange(12.0).reshape(3, 4)

    def f(x):
        y = jaxvmm.reload(jaxvmm.offload(lax.stop_gradient(x)))
        return (y * x).sum()

    g = jax.jit(jax.grad(f))(x)
    assert_bits_equal(g, np.asarray(x))  # d/dx sum(stop_gradient(x) * x) = x
    jaxvmm.check()


# ---------------------------------------------------------------------------------------------------
# the Ticket pytree
# ---------------------------------------------------------------------------------------------------
def test_ticket_is_a_pytree():
    x = random_array((3, 1001), np.float16, seed=7)
    t = jaxvmm.offload(x)
    leaves, treedef = jax.tree_util.tree_flatten(t)
    assert len(leaves) == 1 and leaves[0] is t.token
    assert leaves[0].shape == (2,) and leaves[0].dtype == jnp.uint32
    t2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(t2, jaxvmm.Ticket)
    assert (t2.shape, t2.dtype, t2.nbytes) == ((3, 1001), np.dtype(np.float16), x.nbytes)
    assert "Ticket" in repr(t2) and "float16" in repr(t2)
    # Inside a container, through jit, as an output.
    out = jax.jit(lambda d: {"t": d["t"], "n": d["n"] + 1})({"t": t, "n": jnp.int32(1)})
    assert isinstance(out["t"], jaxvmm.Ticket) and out["t"].shape == (3, 1001)
    assert np.array_equal(np.asarray(out["t"].token), np.asarray(t.token))
    assert_bits_equal(jaxvmm.reload(t2), x)  # t, t2 and out["t"] all name the same ticket
    jaxvmm.synchronize()
    jaxvmm.check()
    with pytest.raises(jaxvmm.InvalidArgumentError):
        jaxvmm.reload(t)  # ...so it is spent for all of them


def test_ticket_returned_from_jit_is_concrete_and_reloadable():
    x = random_array((3, 1001), np.int8, seed=8)
    t = _offload_jit(x)
    assert isinstance(t, jaxvmm.Ticket)
    assert isinstance(t.token, jax.Array) and t.token.shape == (2,) and t.token.dtype == jnp.uint32
    assert ticket_id(t) != 0
    assert_bits_equal(_reload_jit(t), x)


def test_ticket_survives_pytree_rebuild_after_original_dies():
    x = random_array((1000,), np.float32, seed=9)
    t = jaxvmm.offload(x)
    leaves, treedef = jax.tree_util.tree_flatten(t)
    del t
    gc.collect()
    t2 = jax.tree_util.tree_unflatten(treedef, leaves)
    assert_bits_equal(jaxvmm.reload(t2), x)
    jaxvmm.check()


def test_ticket_passed_through_jit_outlives_the_original():
    x = random_array((1000,), np.float32, seed=10)
    t = jaxvmm.offload(x)
    t2 = jax.jit(lambda t: t)(t)
    del t
    gc.collect()
    y = jaxvmm.reload(t2)
    jaxvmm.check()
    assert_bits_equal(y, x)


# ---------------------------------------------------------------------------------------------------
# accounting
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_staging_pages_go_back_on_trim_between_offload_and_reload(platform_device, mode):
    x_np = random_array((3, 1001), np.float32, seed=11)
    x = put(x_np, platform_device)
    jaxvmm.synchronize()
    jaxvmm.trim()
    m0 = mapped(platform_device)
    s0 = estats(platform_device)
    t = jaxvmm.offload(x) if mode == "eager" else _offload_jit(x)
    jax.block_until_ready(t.token)
    jaxvmm.synchronize()
    # The ticket's data lives in pinned host memory now; the staging cell it passed through stays
    # mapped for the next op until trim() (or the idle timeout) returns it.
    assert jaxvmm.trim() > 0
    assert mapped(platform_device) == m0
    s1 = estats(platform_device)
    assert s1["tickets_live"] - s0["tickets_live"] == 1
    assert s1["ticket_host_bytes"] - s0["ticket_host_bytes"] == x_np.nbytes
    assert s1["pinned_in_use_bytes"] >= x_np.nbytes
    assert s1["ops_in_flight"] == 0
    y = jaxvmm.reload(t) if mode == "eager" else _reload_jit(t)
    assert_bits_equal(y, x_np)
    jaxvmm.synchronize()
    jaxvmm.trim()
    assert mapped(platform_device) == m0
    s2 = estats(platform_device)
    assert s2["tickets_live"] == s0["tickets_live"]
    assert s2["ticket_host_bytes"] == s0["ticket_host_bytes"]
    assert s2["pinned_in_use_bytes"] == s0["pinned_in_use_bytes"]
    assert s2["ops_in_flight"] == 0
    assert s2["errors"] == s0["errors"]


def test_steady_state_allocates_no_pinned_memory(platform_device):
    xs = [put(random_array((64, 1000), np.int32, seed=20 + i), platform_device) for i in range(2)]

    @jax.jit
    def step(a, b):
        ta, tb = jaxvmm.offload(a), jaxvmm.offload(b)
        return jaxvmm.reload(tb) + 1, jaxvmm.reload(ta) * 2

    for _ in range(5):  # warm-up, dispatched back to back like the steps below: the pool may grow here
        ys = step(*xs)
    jax.block_until_ready(ys)
    first = estats(platform_device)
    for _ in range(20):
        yb, ya = step(*xs)
    assert_bits_equal(yb, np.asarray(xs[1]) + 1)
    assert_bits_equal(ya, np.asarray(xs[0]) * 2)
    last = estats(platform_device)
    assert last["pinned_allocs"] == first["pinned_allocs"]
    assert last["pinned_bytes"] == first["pinned_bytes"]
    assert last["pinned_in_use_bytes"] == first["pinned_in_use_bytes"]
    assert last["offloads"] - first["offloads"] == 40
    assert last["tickets_live"] == first["tickets_live"]
    jaxvmm.check()


def test_steady_state_pinned_pool_with_small_chunks_subprocess():
    """With 2 MiB pool chunks a pool that failed to reuse freed blocks would need a new chunk every step
    (in-process, earlier tests already pinned a 256 MiB chunk that would hide that). Each step is waited
    for, so that every step needs exactly two blocks at once: steps dispatched back to back may
    legitimately overlap (a ticket's block is freed on the engine's resolver thread, a little after the
    reload) and grow the pool once more."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm, jaxvmm.testing
        jaxvmm.testing.configure_debug(host_pool_chunk=2 << 20)
        a = jnp.arange(384 * 1024, dtype=jnp.float32)      # 1.5 MiB: one block per 2 MiB chunk
        b = -a
        @jax.jit
        def step(a, b):
            ta, tb = jaxvmm.offload(a), jaxvmm.offload(b)
            return jaxvmm.reload(tb), jaxvmm.reload(ta)
        jax.block_until_ready(step(a, b)); jaxvmm.synchronize()
        s0 = jaxvmm.engine_stats()["cpu:0"]
        for _ in range(20):
            yb, ya = step(a, b)
            jaxvmm.synchronize()
        s1 = jaxvmm.engine_stats()["cpu:0"]
        assert np.array_equal(yb, b) and np.array_equal(ya, a)
        assert s0["pinned_allocs"] == 2, s0
        assert s1["pinned_allocs"] == s0["pinned_allocs"], (s0, s1)
        assert s1["pinned_bytes"] == s0["pinned_bytes"], (s0, s1)
        assert s1["pinned_in_use_bytes"] == 0 and s1["tickets_live"] == 0, s1
        assert s1["pinned_peak_in_use_bytes"] == s0["pinned_peak_in_use_bytes"], (s0, s1)
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env()))


def test_reserve_host_pins_a_steps_worth_ahead_subprocess():
    """jaxvmm.reserve_host pins the host memory a step needs before the first step: the steps then pin
    nothing (with 2 MiB chunks, each 1.5 MiB ticket would otherwise take a chunk of its own as the pool
    grows). Past host_pool_limit it raises OutOfMemoryError and pins nothing; bad sizes are refused."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm, jaxvmm.testing
        jaxvmm.testing.configure_debug(host_pool_chunk=2 << 20)
        jaxvmm.configure(host_pool_limit=64 << 20)
        xs = [jnp.full((384 * 1024,), float(i), jnp.float32) for i in range(6)]   # 1.5 MiB each
        step = jax.jit(lambda xs: [jaxvmm.reload(t) for t in reversed([jaxvmm.offload(x) for x in xs])])
        jaxvmm.reserve_host("12M", device="cpu:0")
        s0 = jaxvmm.engine_stats()["cpu:0"]
        assert s0["pinned_allocs"] == 1 and s0["pinned_bytes"] == 12 << 20, s0
        for _ in range(3):
            ys = step(xs)
            jaxvmm.synchronize()
        assert all(np.array_equal(y, x) for y, x in zip(ys, reversed(xs)))
        s1 = jaxvmm.engine_stats()["cpu:0"]
        assert s1["pinned_allocs"] == 1 and s1["pinned_bytes"] == 12 << 20, s1   # all six fit the reserved block
        try:
            jaxvmm.reserve_host(128 << 20)
        except jaxvmm.OutOfMemoryError as e:
            assert "host_pool_limit" in str(e), str(e)
        else:
            raise SystemExit("no error past the limit")
        assert jaxvmm.engine_stats()["cpu:0"]["pinned_bytes"] == 12 << 20
        for bad in (0, -1, "lots", 1.5):
            try:
                jaxvmm.reserve_host(bad)
            except jaxvmm.InvalidArgumentError:
                pass
            else:
                raise SystemExit(f"reserve_host({bad!r}) accepted")
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env()))


# Peak staging memory: peak_mapped_bytes is process-wide and monotonic, so each depth gets a fresh process.
_PEAK_CODE = """
import jax, jax.numpy as jnp, numpy as np, jaxvmm
from jax import lax
from jaxvmm._devices import target_of
from jaxvmm._native import lib
DEPTH, L, PLATFORM = {depth}, {layers}, {platform!r}
assert jaxvmm.configure(prefetch_depth=DEPTH)["prefetch_depth"] == DEPTH
dev = jax.devices(PLATFORM)[0]
tgt = target_of(dev)
shape = (61, 1000)                       # 244000 bytes: not a multiple of a page
nbytes = 61 * 1000 * 4
g = lib.granularity(tgt.backend, tgt.ordinal, "device", tgt.ordinal)
slot = -(-nbytes // g) * g
def peak():
    return jaxvmm.stats()["devices"].get(tgt.name, {{}}).get("peak_mapped_bytes", 0)
def now():
    return jaxvmm.stats()["devices"].get(tgt.name, {{}}).get("mapped_bytes", 0)
h0 = jax.device_put(jnp.ones(shape, jnp.float32), dev)
def fwd(h):
    return lax.scan(lambda h, _: (h * 1.5 + 1.0, jaxvmm.offload(h)), h, None, length=L)
def bwd(ts):
    return lax.scan(lambda c, t: (c, jaxvmm.reload(t)), 0, ts, reverse=True)[1]
@jax.jit
def step(h):                             # a training step's shape: offload per layer, reload in reverse
    hT, ts = fwd(h)
    return hT, bwd(ts)
expected = np.asarray(jax.jit(lambda h: lax.scan(lambda h, _: (h * 1.5 + 1.0, h), h, None, length=L)[1])(h0))
assert peak() == 0
# Every op of one size passes through at most DEPTH staging cells: an offload whose cell is still
# copying out makes XLA's stream wait for it (on the device), a reload's prefetch waits the same way.
# A cell that was never reused, or staging that grows with the number of ops in flight, pushes the
# peak past the bound. The bound is per direction: offloads and reloads draw from pools of their own,
# and where the device runs behind the host (a GPU, or JAXVMM_DEBUG_POSIX_ASYNC) the reloads start while the
# offload cells are still copying out, so both pools hold DEPTH cells. Graph mode (CUDA) adds
# graph_cells cells (2 by default) per call site an initialize stage prepared: a scan body captured
# into a command buffer runs its rounds through them (its warm-up execution runs on the ring path).
def bound():
    channels = jaxvmm.engine_stats().get(tgt.name, {{}}).get("graph_channels", 0)
    return (2 * DEPTH + channels * jaxvmm.configure()["graph_cells"]) * slot
for i in range(3):
    _, ts = jax.jit(fwd)(h0)             # offload and reload in separate executables...
    ys = jax.jit(bwd)(ts)
    assert np.array_equal(np.asarray(ys), expected)
    jaxvmm.synchronize()
    jaxvmm.trim()
    assert now() == 0, now()             # every staging page went back once the copies were done
    assert 0 < peak() <= bound(), (i, "separate", peak() / slot, bound() / slot)
    _, ys = step(h0)                     # ...and in one
    assert np.array_equal(np.asarray(ys), expected)
    jaxvmm.synchronize()
    jaxvmm.trim()
    assert now() == 0, now()
    assert peak() <= bound(), (i, "one jit", peak() / slot, bound() / slot)
jaxvmm.check()
s = jaxvmm.engine_stats()[tgt.name]
assert s["offloads"] == 6 * L and s["reloads"] == 6 * L and s["tickets_live"] == 0 and s["errors"] == 0, s
print("OK peak_slots=%.2f" % (peak() / slot))
"""


@pytest.mark.parametrize("depth", [1, 3])
def test_peak_mapped_bytes_bounded_by_prefetch_depth(platform_device, depth):
    platform = "cpu" if platform_device == "cpu" else "cuda"
    code = _PEAK_CODE.format(depth=depth, layers=LAYERS, platform=platform)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env(platform)))


def test_configure_prefetch_depth_in_process_is_restored():
    old = jaxvmm.configure()["prefetch_depth"]
    h0, ws = _scan_inputs("cpu")
    try:
        for depth in (1, 4):
            assert jaxvmm.configure(prefetch_depth=depth)["prefetch_depth"] == depth
            _, (ts, expected) = _forward_offloading(h0, ws)
            assert_bits_equal(jax.jit(_reload_scan, static_argnums=1)(ts, True), np.asarray(expected))
            jaxvmm.check()
    finally:
        assert jaxvmm.configure(prefetch_depth=old)["prefetch_depth"] == old


def _work(x):
    z = jnp.sort(jnp.cos(x))  # the last read of x
    z2 = jnp.sort(jnp.sin(z) * z)
    z3 = jnp.sort(z2 + z)
    return (z * z2 * z3).sum()


def _keep_alive(a):
    x = jnp.sort(a)  # a materialized value (XLA cannot recompute it inside a fusion)
    s = _work(x)
    return x * s


def _offload_across(a):
    x = jnp.sort(a)
    t = jaxvmm.offload(x)
    s = _work(x)
    # Nothing tells XLA that the reload belongs after the work (the token is ready right after the offload),
    # so make it data-dependent on the work's result, as a backward pass is on its incoming gradient.
    # (s != s) is 0 for the finite s here.
    token = t.token + (s != s).astype(jnp.uint32)
    return jaxvmm.reload(jaxvmm.Ticket(token, t.shape, t.dtype)) * s


def test_offload_reduces_xla_temp_memory(platform_device):
    """XLA buffer assignment: x (4 MiB) no longer lives across the work. On XLA:CPU this shows only with
    the reload made data-dependent on the work (see _offload_across); XLA:CPU's scheduler otherwise hoists
    the reload next to the offload."""
    n = 1 << 20
    spec = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jdev(platform_device)))
    keep = jax.jit(_keep_alive).lower(spec).compile()
    off = jax.jit(_offload_across).lower(spec).compile()
    keep_temp = keep.memory_analysis().temp_size_in_bytes
    off_temp = off.memory_analysis().temp_size_in_bytes
    assert keep_temp - off_temp >= 0.95 * n * 4, (keep_temp, off_temp)
    a = put(np.cos(np.arange(n, dtype=np.float32)), platform_device)
    # Two programs: the sum inside _work may be reduced in another order.
    np.testing.assert_allclose(np.asarray(off(a)), np.asarray(keep(a)), rtol=1e-5)
    jaxvmm.check()


# ---------------------------------------------------------------------------------------------------
# lifetimes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["eager", "jit", "scan_stack"])
def test_dropped_ticket_frees_host_memory(platform_device, how):
    x = put(random_array((3, 1001), np.float32, seed=30), platform_device)
    s0 = estats(platform_device)
    m0 = mapped(platform_device)
    if how == "eager":
        t, n = jaxvmm.offload(x), 1
    elif how == "jit":
        t, n = _offload_jit(x), 1
    else:
        t, n = jax.jit(lambda x: lax.scan(lambda c, _: (c + 1, jaxvmm.offload(c)), x, None, length=4)[1])(x), 4
    jax.block_until_ready(t.token)
    s1 = estats(platform_device)
    assert s1["tickets_live"] - s0["tickets_live"] == n
    assert s1["pinned_in_use_bytes"] - s0["pinned_in_use_bytes"] >= n * x.nbytes
    del t
    gc.collect()
    jaxvmm.synchronize()
    s2 = estats(platform_device)
    assert s2["tickets_live"] == s0["tickets_live"]
    assert s2["pinned_in_use_bytes"] == s0["pinned_in_use_bytes"]
    assert s2["ticket_host_bytes"] == s0["ticket_host_bytes"]
    assert s2["drops"] - s0["drops"] == n
    assert s2["errors"] == s0["errors"]
    assert mapped(platform_device) == m0
    jaxvmm.check()


def test_reloaded_ticket_is_not_counted_as_dropped():
    s0 = estats()
    t = jaxvmm.offload(put(np.arange(10, dtype=np.int32)))
    jaxvmm.reload(t).block_until_ready()
    del t
    gc.collect()
    s1 = estats()
    assert s1["drops"] == s0["drops"]
    assert s1["tickets_live"] == s0["tickets_live"]
    assert s1["reloads"] - s0["reloads"] == 1


@pytest.mark.parametrize("reload_with", ["eager", "jit"])
def test_ticket_dropped_while_its_reload_is_in_flight_still_serves_it(platform_device, reload_with):
    """jit dispatch is asynchronous: the last Python reference to a ticket can die before the reload that
    was already dispatched reaches the engine."""
    xs = [random_array((3, 1001), np.float32, seed=35 + i) for i in range(4)]
    tickets = _offload_jit_list([put(x, platform_device) for x in xs])
    jax.block_until_ready(tickets)
    s0 = estats(platform_device)
    rel = jaxvmm.reload if reload_with == "eager" else _reload_jit
    ys = [rel(t) for t in tickets[::-1]]
    del tickets
    gc.collect()
    jaxvmm.engine_stats()  # runs the drop collection while the reloads may still be in flight
    for y, x in zip(ys, xs[::-1]):
        assert_bits_equal(y, x)
    jaxvmm.check()
    s1 = estats(platform_device)
    assert s1["tickets_live"] == s0["tickets_live"] - 4
    assert s1["errors"] == s0["errors"]


def test_clear_caches_leaks_nothing(platform_device):
    x = put(random_array((3, 1001), np.int32, seed=31), platform_device)

    def run():
        f = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)) + 0)
        g = jax.jit(lambda x: [jaxvmm.offload(x), jaxvmm.offload(-x)])
        h = jax.jit(lambda ts: [jaxvmm.reload(t) for t in ts])
        assert_bits_equal(f(x), np.asarray(x))
        ys = h(g(x)[::-1])
        assert_bits_equal(ys[0], -np.asarray(x))
        assert_bits_equal(ys[1], np.asarray(x))

    def snapshot():
        gc.collect()
        jaxvmm.synchronize()
        jaxvmm.trim()
        s = jaxvmm.stats()
        e = estats(platform_device)
        d = s["devices"].get(dkey(platform_device), {})
        return {"mapped": d.get("mapped_bytes", 0), "quarantined": s["quarantined"], "leaked": s["leaked"],
                "tickets_live": e["tickets_live"], "ticket_host_bytes": e["ticket_host_bytes"],
                "pinned_in_use_bytes": e["pinned_in_use_bytes"], "ops_in_flight": e["ops_in_flight"],
                "errors": e["errors"], "live_mappings": {k: v["live_mappings"] for k, v in s["driver"].items()},
                "live_handles": {k: v["live_handles"] for k, v in s["driver"].items()}}

    run()  # warm: staging slots of this size exist now
    base = snapshot()
    for _ in range(3):
        run()
        jax.clear_caches()
    run()  # recompiles after the cache was cleared
    jax.clear_caches()
    assert snapshot() == base
    jaxvmm.check()


def test_same_jitted_offload_twice_gives_distinct_tickets(platform_device):
    a_np, b_np = (random_array((3, 1001), np.float16, seed=s) for s in (40, 41))
    a, b = put(a_np, platform_device), put(b_np, platform_device)
    s0 = estats(platform_device)
    ta = _offload_jit(a)
    tb = _offload_jit(b)
    tc = _offload_jit(a)  # same executable, same input: still a new ticket
    ids = {ticket_id(t) for t in (ta, tb, tc)}
    assert len(ids) == 3
    s1 = estats(platform_device)
    assert s1["tickets_live"] - s0["tickets_live"] == 3
    assert s1["ticket_host_bytes"] - s0["ticket_host_bytes"] == 3 * a_np.nbytes
    # Oldest first (FIFO): the newer tickets must not have overwritten the older ones.
    assert_bits_equal(_reload_jit(ta), a_np)
    assert_bits_equal(_reload_jit(tc), a_np)
    assert_bits_equal(_reload_jit(tb), b_np)
    jaxvmm.check()
    assert estats(platform_device)["tickets_live"] == s0["tickets_live"]


def test_loop_of_jitted_offloads_before_any_reload(platform_device):
    xs = [random_array((129,), np.int32, seed=50 + i) for i in range(10)]
    tickets = [_offload_jit(put(x, platform_device)) for x in xs]
    for i in (3, 9, 0, 5, 1, 8, 2, 7, 4, 6):
        assert_bits_equal(_reload_jit(tickets[i]), xs[i])
    jaxvmm.check()


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_interpreter_exit_with_outstanding_tickets_is_clean(platform):
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, jaxvmm
        dev = jax.devices({platform!r})[0]
        x = jax.device_put(jnp.arange(30000, dtype=jnp.float32), dev)
        t1 = jaxvmm.offload(x)
        t2 = jax.jit(jaxvmm.offload)(x * 2)
        ts = jax.jit(lambda x: [jaxvmm.offload(x + i) for i in range(3)])(x)
        p = jaxvmm.prefetch(t1)
        t3 = jaxvmm.offload(x); del t3           # a drop still pending at exit
        print("OK", jaxvmm.engine_stats()[{'cpu:0' if platform == 'cpu' else 'cuda:0'!r}]["tickets_live"])
        y = jax.jit(jaxvmm.reload)(t2)           # dispatched, never waited for
    """)
    r = run_in_subprocess(code, env=subprocess_env(platform))
    assert_clean_subprocess(r)
    assert r.stdout.split()[-1] in ("5", "6"), r.stdout  # t3 may be dropped already


# ---------------------------------------------------------------------------------------------------
# bad input: clear errors, the process carries on
# ---------------------------------------------------------------------------------------------------
def test_reload_twice_eager_raises_synchronously(platform_device):
    x_np = random_array((3, 1001), np.float32, seed=60)
    t = jaxvmm.offload(put(x_np, platform_device))
    assert_bits_equal(jaxvmm.reload(t), x_np)
    # The first reload marks the ticket consumed on the engine's resolver thread, which can lag behind the
    # reload's own completion (a correctly predicted reload does not wait for it): see the report's race.
    jaxvmm.synchronize()
    with pytest.raises(jaxvmm.InvalidArgumentError, match=rf"ticket {ticket_id(t)}\b"):
        jaxvmm.reload(t)
    jaxvmm.check()  # nothing asynchronous was recorded: the eager check refused it up front
    assert_bits_equal(_roundtrip_jit(put(x_np, platform_device)), x_np)  # still working


def test_reload_twice_eager_raises_even_while_the_resolver_is_busy():
    # On the cpu platform (explicitly: with a GPU present the default device differs) a prefetch's copy runs
    # synchronously on the resolver thread, so prefetching 32 MiB keeps the resolver busy for a while.
    big = put(np.ones((8 * MiB,), np.float32))
    x = put(random_array((1000,), np.float32, seed=66))
    not_refused = 0
    for _ in range(3):
        tb = jaxvmm.offload(big)
        t = jaxvmm.offload(x)
        jaxvmm.synchronize()
        p = jaxvmm.prefetch(tb)
        assert_bits_equal(jaxvmm.reload(t), np.asarray(x))
        try:
            jaxvmm.reload(t).block_until_ready()
            not_refused += 1
        except jaxvmm.InvalidArgumentError:
            pass
        drain_errors(collect=False)
        jaxvmm.reload(p).block_until_ready()
    assert not_refused == 0, f"{not_refused}/3 second eager reloads were not refused synchronously"


def test_reload_twice_in_jit_reports_on_check(platform_device):
    x_np = random_array((3, 1001), np.float32, seed=61)
    t = _offload_jit(put(x_np, platform_device))
    s0 = estats(platform_device)
    assert_bits_equal(_reload_jit(t), x_np)
    y2 = _reload_jit(t)  # cannot be refused at trace time: the token is data
    jax.block_until_ready(y2)
    assert all_ff(y2)
    with pytest.raises(jaxvmm.InvalidArgumentError, match=rf"ticket {ticket_id(t)}\b") as e:
        jaxvmm.check()
    assert "0xFF" in str(e.value)
    jaxvmm.check()  # taken: raised once
    assert estats(platform_device)["errors"] - s0["errors"] == 1
    # The engine carries on.
    assert_bits_equal(_roundtrip_jit(put(x_np, platform_device)), x_np)
    jaxvmm.check()


def test_async_error_is_raised_by_the_next_handler_if_not_checked():
    x = random_array((64,), np.float32, seed=62)
    t = _offload_jit(x)
    _reload_jit(t).block_until_ready()
    _reload_jit(t).block_until_ready()  # records an asynchronous error
    with pytest.raises(Exception, match=r"ticket \d+"):
        jax.block_until_ready(_roundtrip_jit(jnp.asarray(x)))
    jaxvmm.check()  # the handler took it
    assert_bits_equal(_roundtrip_jit(jnp.asarray(x)), x)


def _forged(device, shape=(3, 1001), dtype=np.float32):
    return jaxvmm.Ticket(put(np.array([123, 456], np.uint32), device), shape, dtype)


def test_forged_ticket_eager_raises(platform_device):
    with pytest.raises(jaxvmm.InvalidArgumentError, match="forged"):
        jaxvmm.reload(_forged(platform_device))
    with pytest.raises(jaxvmm.InvalidArgumentError, match="forged"):
        jaxvmm.prefetch(_forged(platform_device))
    jaxvmm.check()
    x = random_array((3, 1001), np.float32, seed=63)
    assert_bits_equal(jaxvmm.reload(jaxvmm.offload(put(x, platform_device))), x)


def test_forged_ticket_in_jit_reports_on_check(platform_device):
    y = _reload_jit(_forged(platform_device))
    assert all_ff(y)
    with pytest.raises(jaxvmm.InvalidArgumentError, match="forged"):
        jaxvmm.check()


def test_corrupted_token_in_jit_fills_0xff_not_stale_data(platform_device):
    x_np = random_array((3, 1001), np.float32, seed=64)
    x = put(x_np, platform_device)
    # A good reload of the same size first: the staging slot it used held real data.
    assert_bits_equal(_roundtrip_jit(x), x_np)
    t = _offload_jit(x)

    @jax.jit
    def corrupt_and_reload(t):
        token = t.token ^ jnp.array([0, 1 << 7], jnp.uint32)  # flip one check bit
        return jaxvmm.reload(jaxvmm.Ticket(token, t.shape, t.dtype))

    # The engine predicts (same shape and dtype) that this reload is t and prefetches t's real data into the
    # staging slot; the resolver must overwrite it when the token turns out to be bad.
    y = corrupt_and_reload(t)
    jax.block_until_ready(y)
    assert all_ff(y)
    with pytest.raises(jaxvmm.InvalidArgumentError, match="corrupted"):
        jaxvmm.check()
    # The real ticket was not consumed by the bad reload.
    assert_bits_equal(_reload_jit(t), x_np)
    jaxvmm.check()


@pytest.mark.parametrize("other", [((3, 1000), np.float32), ((1001, 3), np.float32), ((3, 1001), np.int32),
                                   ((3, 2002), np.float16)], ids=["nbytes", "shape", "dtype", "both"])
def test_shape_dtype_mismatch(platform_device, other):
    x_np = random_array((3, 1001), np.float32, seed=65)
    t = jaxvmm.offload(put(x_np, platform_device))
    wrong = jaxvmm.Ticket(t.token, *other)
    with pytest.raises(jaxvmm.InvalidArgumentError, match=rf"ticket {ticket_id(t)}\b.*shape/dtype"):
        jaxvmm.reload(wrong)
    y = jax.jit(lambda tok: jaxvmm.reload(jaxvmm.Ticket(tok, *other)))(t.token)
    jax.block_until_ready(y)
    assert y.shape == other[0] and y.dtype == np.dtype(other[1])
    assert all_ff(y)
    with pytest.raises(jaxvmm.InvalidArgumentError, match=r"shape/dtype"):
        jaxvmm.check()
    # The ticket survives both refused reloads.
    assert_bits_equal(jaxvmm.reload(t), x_np)
    jaxvmm.check()


@pytest.mark.parametrize("where", ["eager", "jit"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5)])
def test_zero_size_array_raises_value_error(where, shape):
    x = jnp.zeros(shape, jnp.float32)
    with pytest.raises(ValueError, match="zero-size"):
        (jax.jit(jaxvmm.offload) if where == "jit" else jaxvmm.offload)(x)


@pytest.mark.parametrize("bad", ["prng_key", "legacy_key_is_fine", "object", "list", "python_float", "string",
                                 "ticket"])
def test_non_offloadable_inputs_raise_type_error(bad):
    if bad == "legacy_key_is_fine":  # a raw uint32 key is an ordinary array
        k = jax.random.PRNGKey(0)
        assert_bits_equal(jaxvmm.reload(jaxvmm.offload(k)), np.asarray(k))
        return
    value = {
        "prng_key": lambda: jax.random.key(0),
        "object": lambda: np.array([object(), object()], dtype=object),
        "list": lambda: [1.0, 2.0],
        "python_float": lambda: 1.5,
        "string": lambda: np.array(["ab", "cd"]),
        "ticket": lambda: jaxvmm.offload(jnp.ones(3)),
    }[bad]()
    with pytest.raises(TypeError) as e:
        jaxvmm.offload(value)
    assert "jaxvmm.offload" in str(e.value)
    if bad == "prng_key":
        assert "key_data" in str(e.value)
        with pytest.raises(TypeError):
            jax.jit(jaxvmm.offload)(value)


@pytest.mark.parametrize("bad", [None, 3, "ticket", (1, 2)])
def test_reload_of_non_ticket_raises_type_error(bad):
    with pytest.raises(TypeError, match="jaxvmm.reload"):
        jaxvmm.reload(bad)
    with pytest.raises(TypeError, match="jaxvmm.prefetch"):
        jaxvmm.prefetch(bad)


@pytest.mark.parametrize("token", [np.array([1, 2, 3], np.uint32), np.array([1, 2], np.int32),
                                   np.array([[1, 2, 3]], np.uint32)], ids=["3_words", "int32", "2d"])
def test_ticket_with_malformed_token_raises(token):
    # A numpy token: the Ticket is not tracked for dropping (a malformed jax array token is covered by the subprocess test below).
    with pytest.raises(jaxvmm.InvalidArgumentError, match="uint32\\[2\\]"):
        jaxvmm.reload(jaxvmm.Ticket(token, (4,), np.float32))


def test_malformed_ticket_does_not_poison_later_calls_subprocess():
    # In a subprocess: the bug leaks a live ticket, which would skew the accounting of later tests.
    code = textwrap.dedent("""
        import gc, jax.numpy as jnp, numpy as np, jaxvmm
        t = jaxvmm.offload(np.arange(1000, dtype=np.float32))
        jaxvmm.synchronize()
        try:
            jaxvmm.reload(jaxvmm.Ticket(jnp.array([1, 2, 3], jnp.uint32), (4,), np.float32))
        except jaxvmm.InvalidArgumentError:
            pass
        else:
            raise SystemExit("malformed token accepted")
        del t                                   # a well-formed ticket, dropped in the same batch
        gc.collect()
        jaxvmm.synchronize()                    # must not raise: the bad Ticket's token names nothing
        s = jaxvmm.engine_stats()["cpu:0"]
        assert s["tickets_live"] == 0 and s["drops"] == 1 and s["pinned_in_use_bytes"] == 0, s
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env()))


def test_host_pool_exhausted_is_a_clear_error_subprocess():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm
        assert jaxvmm.configure(host_pool_limit=1 << 20)["host_pool_limit"] == 1 << 20
        x = jnp.ones((1 << 20,), jnp.float32)         # 4 MiB
        for name, fn in (("eager", jaxvmm.offload),
                         ("jit", jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x))))):
            try:
                jax.block_until_ready(fn(x))
            except Exception as e:
                assert "pinned host pool exhausted" in str(e), (name, type(e), str(e))
                print("raised", name)
            else:
                raise SystemExit("no error for " + name)
        jaxvmm.synchronize()
        jaxvmm.check()                                 # nothing left pending
        s = jaxvmm.engine_stats()["cpu:0"]
        assert s["tickets_live"] == 0 and s["pinned_in_use_bytes"] == 0, s
        small = jnp.arange(1000, dtype=jnp.float32)    # fits under the cap: the process carries on
        assert np.array_equal(jaxvmm.reload(jaxvmm.offload(small)), small)
        jaxvmm.configure(host_pool_limit=64 << 20)     # raising the cap makes the big one work
        assert np.array_equal(jaxvmm.reload(jaxvmm.offload(x)), x)
        jaxvmm.synchronize(); jaxvmm.check()
        print("OK")
    """)
    r = run_in_subprocess(code, env=subprocess_env())
    assert_clean_subprocess(r)
    assert "raised eager" in r.stdout and "raised jit" in r.stdout


def test_eager_offload_past_the_host_pool_cap_is_one_error_whatever_the_timing_subprocess():
    """An eager offload past host_pool_limit raised jaxvmm.OutOfMemoryError when its input was already
    computed, and jax's JaxRuntimeError (later, where the token was used) when it was not."""
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm
        jaxvmm.configure(host_pool_limit=1 << 20)
        big = jnp.zeros((1 << 20,), jnp.float32)      # 4 MiB
        big.block_until_ready()
        m = jnp.ones((2000, 2000), jnp.float32)
        inputs = [("computed", lambda: big)] + [("in flight", lambda: (m @ m @ m @ m).sum() * 0 + big)] * 3
        for name, make in inputs:
            x = make()
            try:
                t = jaxvmm.offload(x)
                jax.block_until_ready(t.token)
            except jaxvmm.VmmError as e:
                assert isinstance(e, jaxvmm.OutOfMemoryError), (name, type(e))
                assert "host_pool_limit" in str(e), str(e)
                print("raised", name)
            else:
                raise SystemExit("no error for an input " + name)
        jaxvmm.synchronize(); jaxvmm.check()
        print("OK")
    """)
    r = run_in_subprocess(code, env=subprocess_env())
    assert_clean_subprocess(r)
    assert "raised computed" in r.stdout and "raised in flight" in r.stdout


@pytest.mark.parametrize("knob", ["host_pool_limit", "host_pool_chunk", "prefetch_depth", "keep_resident",
                                  "staging_budget", "staging_idle_ms"])
@pytest.mark.parametrize("value", [0, -1, True, False, 1.5, "4", np.float32(2)])
def test_configure_rejects_bad_values(knob, value):
    if knob == "keep_resident" and value == 0 and not isinstance(value, bool):
        pytest.skip("keep_resident=0 is valid (the default)")
    if knob in ("host_pool_limit", "host_pool_chunk", "staging_budget") and value == "4":
        pytest.skip("size strings are valid for the size knobs ('4' = 4 bytes; see tests/test_config.py)")
    setter = jaxvmm.testing.configure_debug if knob == "host_pool_chunk" else jaxvmm.configure  # a debug setting
    before = setter()
    try:
        with pytest.raises(ValueError, match=knob):
            setter(**{knob: value})
    finally:
        after = setter(**before)  # a value wrongly accepted must not leak into later tests
    assert after == before


def test_configure_returns_values_in_force():
    cur = jaxvmm.configure()
    assert set(cur) == {"host_pool_limit", "prefetch_depth", "keep_resident", "staging_budget", "staging_idle_ms",
                        "host_store", "graph_cells", "graph_spare_budget"}
    assert cur["host_store"] in ("pinned", "host_numa")
    assert all(isinstance(v, int) and v >= (0 if k in ("keep_resident", "graph_spare_budget") else 1)
               for k, v in cur.items() if k != "host_store")
    debug = jaxvmm.testing.configure_debug()
    try:
        assert jaxvmm.configure(prefetch_depth=np.int64(5))["prefetch_depth"] == 5
        assert jaxvmm.configure()["prefetch_depth"] == 5
        assert jaxvmm.testing.configure_debug(graph_spares=7)["graph_spares"] == 7
        assert jaxvmm.testing.configure_debug()["graph_spares"] == 7
    finally:
        jaxvmm.configure(prefetch_depth=cur["prefetch_depth"])
        jaxvmm.testing.configure_debug(graph_spares=debug["graph_spares"])
    assert jaxvmm.configure() == cur and jaxvmm.testing.configure_debug() == debug


def test_eager_calls_from_one_line_compile_once(platform_device):
    """Outside jit each offload/reload/prefetch runs as a one-op program whose attributes include its
    call-site number: a call from the same source line with the same shape, dtype and device reuses its
    number, so the program compiles once, not at every call (it cost a compile per call, ~10 ms on cpu,
    and on a GPU a new graph-mode channel and a drain of pending rounds each). Another shape, another
    line: another site."""
    from jax import monitoring
    compiles = []

    def listen(event, *a, **k):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listen)
    try:
        _eager_round_trips(platform_device, compiles)
    finally:
        monitoring.unregister_event_duration_listener(listen)


def _eager_round_trips(platform_device, compiles):
    xs = [put(random_array((4, 257), np.float32, seed=90 + i), platform_device) for i in range(12)]
    other = put(random_array((3, 5), np.float32, seed=99), platform_device)

    def roundtrip(x):
        return jaxvmm.reload(jaxvmm.prefetch(jaxvmm.offload(x)))

    assert_bits_equal(roundtrip(xs[0]), np.asarray(xs[0]))  # compiles each op once
    n0 = len(compiles)
    for x in xs[1:]:
        assert_bits_equal(roundtrip(x), np.asarray(x))
    assert len(compiles) == n0, f"{len(compiles) - n0} compiles in {len(xs) - 1} eager round trips"
    assert_bits_equal(roundtrip(other), np.asarray(other))  # another shape: its own programs
    assert len(compiles) > n0
    t1, t2 = jaxvmm.offload(xs[0]), jaxvmm.offload(xs[1])  # one line each: two sites
    assert_bits_equal(jaxvmm.reload(t2), np.asarray(xs[1]))
    assert_bits_equal(jaxvmm.reload(t1), np.asarray(xs[0]))
    jaxvmm.check()


# ---------------------------------------------------------------------------------------------------
# prefetch
# ---------------------------------------------------------------------------------------------------
def test_prefetch_eager(platform_device):
    x_np = random_array((3, 1001), np.float32, seed=70)
    s0 = estats(platform_device)
    t = jaxvmm.offload(put(x_np, platform_device))
    p = jaxvmm.prefetch(t)
    assert isinstance(p, jaxvmm.Ticket) and (p.shape, p.dtype) == (t.shape, t.dtype)
    assert_bits_equal(jaxvmm.reload(p), x_np)
    jaxvmm.check()
    del t, p
    s1 = estats(platform_device)
    assert s1["prefetches"] - s0["prefetches"] == 1
    assert s1["tickets_live"] == s0["tickets_live"]
    assert s1["pinned_in_use_bytes"] == s0["pinned_in_use_bytes"]
    assert s1["errors"] == s0["errors"]


def test_prefetch_out_of_order_in_jit(platform_device):
    xs = [random_array((3, 1001), np.float32, seed=80 + i) for i in range(4)]
    s0 = estats(platform_device)
    m0 = mapped(platform_device)
    tickets = _offload_jit_list([put(x, platform_device) for x in xs])

    @jax.jit
    def f(ts):
        # Reload the oldest first (against the default LIFO guess), hinting it ahead of time.
        p0 = jaxvmm.prefetch(ts[0])
        p2 = jaxvmm.prefetch(ts[2])
        return [jaxvmm.reload(p0), jaxvmm.reload(p2), jaxvmm.reload(ts[3]), jaxvmm.reload(ts[1])]

    ys = f(tickets)
    for y, i in zip(ys, (0, 2, 3, 1)):
        assert_bits_equal(y, xs[i])
    jaxvmm.check()
    s1 = estats(platform_device)
    assert s1["prefetches"] - s0["prefetches"] == 2
    assert s1["reloads"] - s0["reloads"] == 4
    assert s1["tickets_live"] == s0["tickets_live"]
    assert s1["errors"] == s0["errors"]
    assert mapped(platform_device) == m0  # prefetched device copies went back with their tickets


def test_prefetch_of_spent_ticket_reports_on_check():
    t = _offload_jit(np.arange(100, dtype=np.float32))
    _reload_jit(t).block_until_ready()
    jax.jit(jaxvmm.prefetch)(t).token.block_until_ready()
    jaxvmm.synchronize()  # a prefetch is a hint: XLA's stream does not wait for its resolution
    with pytest.raises(jaxvmm.InvalidArgumentError, match=rf"prefetch.*ticket {ticket_id(t)}\b"):
        jaxvmm.check()


def test_prefetch_rebinding_keeps_the_data():
    x = random_array((1000,), np.float32, seed=90)
    t = jaxvmm.offload(x)
    t = jaxvmm.prefetch(t)
    gc.collect()
    y = jaxvmm.reload(t)
    jaxvmm.check()
    assert_bits_equal(y, x)


# ---------------------------------------------------------------------------------------------------
# GPU only
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("dtype", [_dtype_param(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8)])
def test_gpu_large_roundtrip_bit_exact(dtype, mode):
    itemsize = np.dtype(dtype).itemsize
    n = -(-5_000_003 // itemsize)  # about 5 MB: not a multiple of the 2 MiB granularity
    assert (n * itemsize) % (2 * MiB) != 0
    x_np = random_array((n,), dtype, seed=itemsize)
    x = put(x_np, "cuda:0")
    s0 = estats("cuda:0")
    y = jaxvmm.reload(jaxvmm.offload(x)) if mode == "eager" else _roundtrip_jit(x)
    assert_bits_equal(y, x_np)
    jaxvmm.check()
    assert estats("cuda:0")["tickets_live"] == s0["tickets_live"]


@pytest.mark.gpu
def test_gpu_staging_pages_go_back_to_the_driver():
    dev = "cuda:0"
    n = 1 << 28  # 1 GiB of float32
    x = jax.device_put(jnp.arange(n, dtype=jnp.int32).view(jnp.float32), jdev(dev))
    off = jax.jit(jaxvmm.offload)
    rel = jax.jit(jaxvmm.reload)
    x.block_until_ready()
    s0 = estats(dev)
    m0 = mapped(dev)
    free_before, _ = jaxvmm.driver_memory_info(dev)
    t = off(x)
    jax.block_until_ready(t.token)
    jaxvmm.synchronize()
    # The 1 GiB staging slot was mapped for the copy and handed back: between offload and reload the
    # data is only in pinned host memory.
    assert mapped(dev) == m0 == 0
    free_between, _ = jaxvmm.driver_memory_info(dev)
    assert free_between >= free_before - 64 * MiB, (free_before, free_between)
    s1 = estats(dev)
    assert s1["ticket_host_bytes"] - s0["ticket_host_bytes"] == n * 4
    assert s1["tickets_live"] - s0["tickets_live"] == 1
    y = rel(t)
    y.block_until_ready()
    jaxvmm.synchronize()
    assert mapped(dev) == m0
    free_after, _ = jaxvmm.driver_memory_info(dev)
    # Only XLA's own 1 GiB output may be new (without preallocation XLA's allocator took it from the driver).
    assert free_after >= free_before - n * 4 - 64 * MiB, (free_before, free_after)
    assert bool(jnp.array_equal(y.view(jnp.int32), jnp.arange(n, dtype=jnp.int32)))
    s2 = estats(dev)
    assert s2["tickets_live"] == s0["tickets_live"]
    assert s2["pinned_in_use_bytes"] == s0["pinned_in_use_bytes"]
    jaxvmm.check()


@pytest.mark.gpu
def test_gpu_back_to_back_reloads_map_no_pages():
    """Reloads of one size in a row reuse the staging cells (their prefetches wait on the device for the
    previous user) instead of mapping pages per op; the data and the accounting stay exact."""
    dev, n, k = "cuda:0", 16 * MiB + 4096, 8  # 64 MiB of float32 per ticket, not granularity-aligned
    xs = [put(random_array((n,), np.float32, seed=i), dev) for i in range(k)]
    off = jax.jit(jaxvmm.offload)
    rel = jax.jit(jaxvmm.reload)
    tickets = [off(x) for x in xs]
    jax.block_until_ready([t.token for t in tickets])
    jaxvmm.synchronize()
    s0 = estats(dev)
    ys = [rel(t) for t in reversed(tickets)]  # newest first, queued without waiting
    for x, y in zip(reversed(xs), ys):  # compared as bits: the data holds NaN patterns
        assert bool(jnp.array_equal(x.view(jnp.uint32), y.view(jnp.uint32)))
    jaxvmm.synchronize()
    s1 = estats(dev)
    assert s1["staging_pages_mapped"] - s0["staging_pages_mapped"] <= jaxvmm.configure()["prefetch_depth"], (s0, s1)
    assert s1["staging_acquires"] - s0["staging_acquires"] == k, (s0, s1)
    assert mapped(dev) == 0
    assert s1["errors"] == s0["errors"] and s1["tickets_live"] == s0["tickets_live"] - k
    jaxvmm.check()


@pytest.mark.gpu
@pytest.mark.parametrize("depth", [2, 4])
def test_gpu_offload_while_reloading_with_a_deep_prefetch_subprocess(depth):
    """Each call offloads one array and reloads the one offloaded two calls earlier, after a newest-first
    phase taught the engine LIFO (so the first reloads mispredict). With depth > 2 the mapper prefetches
    later reloads while an earlier misprediction still needs its correction: the correction must not
    queue behind those prefetches (it once deadlocked XLA's stream)."""
    code = textwrap.dedent(f"""
        import collections, jax, jax.numpy as jnp, numpy as np, jaxvmm
        assert jaxvmm.configure(prefetch_depth={depth})["prefetch_depth"] == {depth}
        n = 16 << 20  # 64 MiB of float32
        xs = [jnp.full((n,), i, jnp.float32) for i in range(12)]
        off, rel = jax.jit(jaxvmm.offload), jax.jit(jaxvmm.reload)
        both = jax.jit(lambda x, t: (jaxvmm.offload(x), jaxvmm.reload(t)))
        ts = [off(x) for x in xs[:4]]
        for t, x in zip(reversed(ts), reversed(xs[:4])):  # newest first: the engine predicts LIFO
            assert bool(jnp.array_equal(rel(t), x))
        del ts
        jaxvmm.synchronize()
        queue = collections.deque((off(xs[0]), 0) for _ in range(1))
        queue.append((off(xs[1]), 1))
        pending = collections.deque()
        for i in range(2, 12):
            t_old, j = queue.popleft()
            t_new, y = both(xs[i], t_old)
            queue.append((t_new, i))
            pending.append((y, j))
            if len(pending) > 2:
                y, j = pending.popleft()
                assert bool(jnp.array_equal(y, xs[j])), j
        for y, j in pending:
            assert bool(jnp.array_equal(y, xs[j])), j
        del queue
        jaxvmm.synchronize()
        jaxvmm.check()
        print("OK", jaxvmm.engine_stats()["cuda:0"]["prefetch_misses"])
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env("cuda"), timeout=180))


@pytest.mark.gpu
def test_gpu_thousand_cycles_do_not_grow():
    dev = "cuda:0"
    x_np = random_array((2 * MiB + 12345,), np.int8, seed=99)
    x = put(x_np, dev)
    step = jax.jit(lambda x: jaxvmm.reload(jaxvmm.offload(x)))
    for _ in range(10):
        y = step(x)
    y.block_until_ready()
    jaxvmm.synchronize()
    free0, total = jaxvmm.driver_memory_info(dev)
    s0 = estats(dev)
    m0 = mapped(dev)
    for i in range(1000):
        y = step(x)
        if i % 100 == 99:
            y.block_until_ready()
    assert_bits_equal(y, x_np)
    jaxvmm.synchronize()
    free1, _ = jaxvmm.driver_memory_info(dev)
    assert (total - free1) - (total - free0) <= 64 * MiB, (free0, free1)
    s1 = estats(dev)
    assert mapped(dev) == m0 == 0
    assert s1["tickets_live"] == s0["tickets_live"] and s1["pinned_in_use_bytes"] == s0["pinned_in_use_bytes"]
    assert s1["offloads"] - s0["offloads"] == 1000 and s1["reloads"] - s0["reloads"] == 1000
    assert s1["pinned_allocs"] == s0["pinned_allocs"]
    assert s1["errors"] == s0["errors"]
    jaxvmm.check()


def _shard_map():
    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    params = inspect.signature(fn).parameters
    extra = {"check_vma": False} if "check_vma" in params else {"check_rep": False} if "check_rep" in params else {}
    return lambda f, **kw: fn(f, **kw, **extra)


@pytest.mark.gpu
def test_gpu_two_devices_shard_map():
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip(f"needs 2 gpu devices, jax sees {len(gpus)}")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    shard_map = _shard_map()
    mesh = Mesh(np.array(gpus[:2]), ("x",))
    x_np = random_array((2, 3, 100_003), np.float32, seed=7)
    x = jax.device_put(x_np, NamedSharding(mesh, P("x")))
    s0 = {d: estats(d) for d in ("cuda:0", "cuda:1")}

    roundtrip = jax.jit(shard_map(lambda v: jaxvmm.reload(jaxvmm.offload(v)), mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x")))
    assert_bits_equal(roundtrip(x), x_np)

    # Tickets crossing calls: each device's token comes back as one shard of the global token.
    off = jax.jit(shard_map(jaxvmm.offload, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    rel = jax.jit(shard_map(jaxvmm.reload, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    t = off(x)
    assert_bits_equal(rel(t), x_np)
    jaxvmm.check()
    jaxvmm.synchronize()
    for d in ("cuda:0", "cuda:1"):
        s1 = estats(d)
        assert s1["offloads"] - s0[d]["offloads"] == 2, (d, s1)
        assert s1["reloads"] - s0[d]["reloads"] == 2, (d, s1)
        assert s1["tickets_live"] == s0[d]["tickets_live"] and s1["errors"] == s0[d]["errors"], (d, s1)


def test_tickets_are_per_device_subprocess():
    # Two cpu devices, one engine each: ticket numbers coincide, so both the drop bookkeeping and the
    # token check must tell the devices apart (a GPU run leaked cuda tickets while cpu tokens with equal
    # numbers were alive).
    code = textwrap.dedent("""
        import gc, jax, jax.numpy as jnp, numpy as np, jaxvmm
        d0, d1 = jax.devices("cpu")[:2]
        x = np.arange(1000, dtype=np.float32)
        t0 = jaxvmm.offload(jax.device_put(x, d0))
        t1 = jaxvmm.offload(jax.device_put(x, d1))
        jaxvmm.synchronize()
        s = jaxvmm.engine_stats()
        assert s["cpu:0"]["tickets_live"] == 1 and s["cpu:1"]["tickets_live"] == 1, s
        try:   # t1's token presented to cpu:0's engine
            jaxvmm.reload(jaxvmm.Ticket(jax.device_put(t1.token, d0), t1.shape, t1.dtype))
        except jaxvmm.InvalidArgumentError as e:
            assert "this device" in str(e), e
        else:
            raise SystemExit("a ticket of cpu:1 was accepted by cpu:0")
        del t0
        gc.collect()
        jaxvmm.synchronize()
        s = jaxvmm.engine_stats()
        assert s["cpu:0"]["tickets_live"] == 0 and s["cpu:1"]["tickets_live"] == 1, s
        assert np.array_equal(np.asarray(jaxvmm.reload(t1)), x)
        print("OK")
    """)
    env = subprocess_env()
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    assert_clean_subprocess(run_in_subprocess(code, env=env))


def test_offload_works_when_jax_has_no_cpu_backend(monkeypatch):
    # On a GPU machine with JAX_PLATFORMS=cuda, jax.devices("cpu") raises; jaxvmm must not care.
    from jaxvmm import _devices

    def no_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return real(backend)

    real = jax.devices
    _devices._posix_ready.cache_clear()
    monkeypatch.setattr(jax, "devices", no_cpu)
    try:
        _devices._posix_ready()  # must not raise
    finally:
        monkeypatch.undo()
        _devices._posix_ready.cache_clear()
        _devices._posix_ready()


def test_keep_resident_reloads_from_device_copies_subprocess():
    # keep_resident=K: the newest K offloads keep their staging pages after the D2H; their reloads
    # are exact, the extra mapped bytes are K slots at most, and everything is returned at the end.
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm
        from jax import lax
        assert jaxvmm.configure(keep_resident=2)["keep_resident"] == 2
        L, shape = 6, (61, 1000)
        slot = 245760  # 61*1000*4 bytes, rounded to pages
        fwd = jax.jit(lambda h: lax.scan(lambda h, _: (h + 1, jaxvmm.offload(h)), h, None, length=L)[1])
        bwd = jax.jit(lambda ts: lax.scan(lambda c, t: (c, jaxvmm.reload(t)), 0, ts, reverse=True)[1])
        h = jnp.zeros(shape, jnp.float32)
        for step in range(3):
            ts = fwd(h)
            jaxvmm.synchronize()
            jaxvmm.trim()  # the cells ops passed through go back; kept copies stay
            m = jaxvmm.stats()["mapped_bytes"]
            assert m == 2 * slot, (step, m)  # exactly the two newest tickets stay on the device
            ys = bwd(ts)
            want = np.stack([np.full(shape, i, np.float32) for i in range(L)])
            assert np.array_equal(np.asarray(ys), want), step
            del ts, ys
            jaxvmm.synchronize()
            jaxvmm.trim(); assert jaxvmm.stats()["mapped_bytes"] == 0, jaxvmm.stats()["mapped_bytes"]
        s = jaxvmm.engine_stats()["cpu:0"]
        assert s["tickets_live"] == 0 and s["errors"] == 0, s
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env()))


# ---- regressions found by review (each ran in a subprocess: a failure there is a hang or a leak) ----
def test_concurrent_handlers_do_not_deadlock_subprocess():
    # XLA:CPU runs independent custom calls on several threads; the mapper must still see ops in
    # sequence order (it used to block on an op queued behind the one it waited for).
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm
        jaxvmm.configure(prefetch_depth=1)
        xs = [jnp.full((1 << 14,), i, jnp.float32) for i in range(16)]
        f = jax.jit(lambda xs: [jaxvmm.reload(jaxvmm.offload(x)) * 2 for x in xs])
        for it in range(60):
            ys = jax.block_until_ready(f(xs))
            assert all(float(y[0]) == 2 * i for i, y in enumerate(ys))
        jaxvmm.synchronize()
        s = jaxvmm.engine_stats()["cpu:0"]
        assert s["tickets_live"] == 0 and s["errors"] == 0, s
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env(), timeout=180))


def test_failed_enqueue_leaks_nothing_and_later_reloads_work_subprocess():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, jaxvmm, jaxvmm.testing as jt
        jaxvmm.configure(prefetch_depth=2)
        x = jnp.arange(4096, dtype=jnp.float32)
        for i in range(4):
            t = jaxvmm.offload(x + i)
            jax.block_until_ready(t.token)
            jt.arm_fault("cuEventRecord", nth=2, times=1)  # the reload's completion event
            try:
                jax.block_until_ready(jaxvmm.reload(t))
            except Exception:
                pass
            finally:
                jt.clear_faults()
            try:
                jaxvmm.check()
            except jaxvmm.VmmError:
                pass
        y = jaxvmm.reload(jaxvmm.offload(x))  # hung here when failed reloads leaked their staging cap
        assert float(y[1]) == 1.0
        del t
        jaxvmm.synchronize()
        jaxvmm.trim(); assert jaxvmm.stats()["mapped_bytes"] == 0, jaxvmm.stats()["mapped_bytes"]
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env(), timeout=120))


def test_keep_resident_with_prefetch_returns_all_pages_subprocess():
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm
        jaxvmm.configure(keep_resident=1)
        x = jnp.arange(1 << 18, dtype=jnp.float32)
        for i in range(40):
            t = jaxvmm.prefetch(jaxvmm.offload(x + i))
            y = jaxvmm.reload(t)
            assert float(y[0]) == i
        del t, y
        jaxvmm.synchronize()
        jaxvmm.trim()
        s = jaxvmm.stats()
        jaxvmm.trim()
        assert jaxvmm.stats()["mapped_bytes"] == 0, jaxvmm.stats()["mapped_bytes"]
        assert jaxvmm.engine_stats()["cpu:0"]["tickets_live"] == 0
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env(), timeout=120))


def test_failed_eager_reload_can_be_retried_subprocess():
    # An eager reload reserves its ticket; when the reload itself fails before running, the ticket must
    # not stay reserved (it was never reloaded).
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np, jaxvmm, jaxvmm.testing as jt
        x = jnp.arange(4096, dtype=jnp.float32)
        t = jaxvmm.offload(x)
        jaxvmm.synchronize()
        jt.arm_fault("cuEventRecord", nth=1, times=1)  # the reload's first event (its prefetch) fails
        try:
            jax.block_until_ready(jaxvmm.reload(t))
        except Exception:
            pass
        else:
            raise SystemExit("the injected fault did not fail the reload")
        finally:
            jt.clear_faults()
        try:
            jaxvmm.check()
        except jaxvmm.VmmError:
            pass
        y = jaxvmm.reload(t)
        assert np.array_equal(np.asarray(y), np.asarray(x))
        print("OK")
    """)
    assert_clean_subprocess(run_in_subprocess(code, env=subprocess_env()))


_ASYNC_CODE = """
import jax, jax.numpy as jnp, numpy as np, jaxvmm
from jax import lax
dev = jax.devices("cpu")[0]
h0 = jax.device_put(jnp.linspace(-1.0, 1.0, 300 * 1000, dtype=jnp.float32).reshape(300, 1000), dev)
L = 12
def fwd(h):
    return lax.scan(lambda h, _: (jnp.sin(h) * 1.5 + 0.25, jaxvmm.offload(h)), h, None, length=L)
def bwd(ts):
    return lax.scan(lambda c, t: (c, jaxvmm.reload(t)), 0, ts, reverse=True)[1]
@jax.jit
def step(h):
    hT, ts = fwd(h)
    return hT, bwd(ts)
expected = np.asarray(jax.jit(lambda h: lax.scan(lambda h, _: (jnp.sin(h) * 1.5 + 0.25, h), h, None, length=L)[1])(h0))
for i in range(4):
    _, ts = jax.jit(fwd)(h0)                 # tickets across two programs
    assert np.array_equal(np.asarray(jax.jit(bwd)(ts)), expected), i
    assert np.array_equal(np.asarray(step(h0)[1]), expected), i   # and inside one
jaxvmm.check()
jaxvmm.synchronize()
s = jaxvmm.engine_stats()["cpu:0"]
assert s["offloads"] == s["reloads"] == 8 * L and s["tickets_live"] == 0 and s["errors"] == 0, s
print("OK")
"""


def test_scans_of_offloads_and_reloads_are_bit_exact_when_the_cpu_streams_run_asynchronously():
    """JAXVMM_DEBUG_POSIX_ASYNC=300: the cpu backend runs every driver stream on a thread of its own, each
    operation after a random delay of up to 300 us, as a busy GPU's streams do. Only the engine's
    ordering (events, value waits, host functions waking the workers) keeps the bytes right."""
    env = dict(subprocess_env("cpu"), JAXVMM_DEBUG_POSIX_ASYNC="300")
    assert_clean_subprocess(run_in_subprocess(_ASYNC_CODE, env=env))
