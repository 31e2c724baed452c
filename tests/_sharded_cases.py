"""Checks of offload/reload/prefetch and jaxvmm.checkpoint on arrays sharded under plain ``jit``.

Shared by ``test_sharded.py``: its cpu tests run ``python _sharded_cases.py CASE PARTITIONER`` in a
subprocess with 4 forced host devices (the main pytest process has one), and its 2-GPU tests call
the functions here directly. Every check raises AssertionError with what it saw; a case prints
``CASE OK`` at the end.
"""

from __future__ import annotations

import gc
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxvmm

COLLECTIVES = ("all-gather", "all-to-all", "all-reduce", "collective-permute", "reduce-scatter")


def dkey(device) -> str:
    return f"{'cuda' if device.platform == 'gpu' else 'cpu'}:{device.id if device.platform == 'cpu' else device.local_hardware_id}"


def stats(devices) -> dict:
    jaxvmm.synchronize()
    s = jaxvmm.engine_stats()
    zero = {"offloads": 0, "reloads": 0, "tickets_live": 0, "ticket_host_bytes": 0, "errors": 0, "prefetches": 0}
    return {d: {**zero, **s.get(dkey(d), {})} for d in devices}


def delta(before, after, key) -> dict:
    return {d: after[d][key] - before[d][key] for d in before}


def collectives(hlo: str) -> list[str]:
    """The lines of compiled HLO text that run a collective (data moving between devices)."""
    return [line.strip()[:160] for line in hlo.splitlines()
            if any(re.search(rf"\b{c}(-start)?\(", line) for c in COLLECTIVES)]


def elements(line: str) -> int:
    """Elements of the (first) array an HLO instruction line produces."""
    m = re.search(r"= \(?\w+\[([\d,]*)\]", line)
    return int(np.prod([int(d) for d in m.group(1).split(",") if d], dtype=np.int64)) if m else 0


def bits(a) -> bytes:
    a = np.asarray(a)
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def random_bits(shape, dtype, seed=0) -> np.ndarray:
    """Random bits (NaN payloads and -0.0 included for floats): only an exact copy matches."""
    dtype = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def same_sharding(a, b, ndim) -> bool:
    return a.is_equivalent_to(b, ndim)


def local_nbytes(x) -> dict:
    """Bytes of each device's shard of ``x``."""
    return {s.device: s.data.nbytes for s in x.addressable_shards}


# ---------------------------------------------------------------------------------------------------
# Offload / reload of one array
# ---------------------------------------------------------------------------------------------------
def check_roundtrip(mesh, spec, shape=(8, 12), dtype=np.float32, seed=0) -> None:
    """Offload in one jit (the ticket comes out), reload in another; then both in one jit. Values are
    bit-exact, the output keeps the input's sharding, the compiled programs move no data between
    devices, and each device's host copy is its own shard (one copy of the array when sharded)."""
    devices = list(mesh.devices.flat)
    sharding = NamedSharding(mesh, spec)
    x_np = random_bits(shape, dtype, seed)
    x = jax.device_put(x_np, sharding)
    s0 = stats(devices)

    off = jax.jit(jaxvmm.offload)
    hlo = off.lower(x).compile().as_text()
    assert not collectives(hlo), (spec, collectives(hlo))
    t = off(x)
    assert t.sharded and t.token.dtype == jnp.uint32 and t.token.shape[-1] == 2, t
    s1 = stats(devices)
    held = delta(s0, s1, "ticket_host_bytes")
    want = {d: n for d, n in local_nbytes(x).items()}
    assert held == want, (spec, held, want)
    assert all(v == 1 for v in delta(s0, s1, "tickets_live").values()), (spec, s1)
    # One copy of the array when it is sharded over every device; a copy per replica otherwise
    # (devices holding the same data each keep their own).
    assert sum(held.values()) == x_np.nbytes * _replicas(mesh, spec), (spec, held, x_np.nbytes)

    rel = jax.jit(jaxvmm.reload)
    hlo = rel.lower(t).compile().as_text()
    assert not collectives(hlo), (spec, collectives(hlo))
    y = rel(t)
    assert bits(y) == bits(x_np), spec
    assert same_sharding(y.sharding, x.sharding, len(shape)), (spec, y.sharding, x.sharding)

    both = jax.jit(lambda v: jaxvmm.reload(jaxvmm.offload(v)))
    hlo = both.lower(x).compile().as_text()
    assert not collectives(hlo), (spec, collectives(hlo))
    assert hlo.count("jaxvmm_offload") >= 1 and hlo.count("jaxvmm_reload") >= 1
    y = both(x)
    assert bits(y) == bits(x_np), spec
    assert same_sharding(y.sharding, x.sharding, len(shape)), (spec, y.sharding)
    s2 = stats(devices)
    assert delta(s0, s2, "offloads") == {d: 2 for d in devices}, (spec, delta(s0, s2, "offloads"))
    assert delta(s0, s2, "reloads") == {d: 2 for d in devices}, (spec, delta(s0, s2, "reloads"))
    assert delta(s0, s2, "tickets_live") == {d: 0 for d in devices}, (spec, s2)
    assert delta(s0, s2, "errors") == {d: 0 for d in devices}, (spec, s2)
    jaxvmm.check()


def _replicas(mesh, spec) -> int:
    used = set()
    for e in spec:
        used.update((e,) if isinstance(e, str) else e or ())
    return int(np.prod([n for a, n in zip(mesh.axis_names, mesh.axis_sizes) if a not in used], dtype=np.int64))


def meshes_and_specs(devices):
    d1 = Mesh(np.array(devices[:4]), ("d",))
    d2 = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    return [
        (d1, P("d")), (d1, P(None, "d")), (d1, P()),
        (d2, P("a", "b")), (d2, P("b", "a")), (d2, P(("a", "b"))), (d2, P(None, ("b", "a"))),
        (d2, P("a")), (d2, P(None, "b")),
    ]


def case_roundtrip() -> None:
    devices = jax.devices("cpu")
    for mesh, spec in meshes_and_specs(devices):
        check_roundtrip(mesh, spec)
    # Other ranks and dtypes, a dimension the mesh does not divide evenly into token cells.
    d2 = Mesh(np.array(devices[:4]).reshape(2, 2), ("a", "b"))
    check_roundtrip(d2, P(None, "a", "b"), shape=(3, 4, 6), dtype=np.uint8)
    check_roundtrip(d2, P("b"), shape=(6,), dtype=jnp.bfloat16)
    check_roundtrip(Mesh(np.array(devices[:4]), ("d",)), P("d"), shape=(4, 3, 5), dtype=np.int64
                    if jax.config.jax_enable_x64 else np.int32)


def case_prefetch_after() -> None:
    """prefetch and reload(after=) on sharded tickets inside one jit; eager offload/reload of a
    committed sharded array; the token keeps the data's sharding."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
    x_np = random_bits((8, 8), np.float32, 3)
    x = jax.device_put(x_np, NamedSharding(mesh, P("a", "b")))
    s0 = stats(devices)

    @jax.jit
    def f(v):
        t = jaxvmm.offload(v)
        z = jnp.sin(v) * 2
        t = jaxvmm.prefetch(t)
        return jaxvmm.reload(t, after=z), z

    y, _ = f(x)
    assert bits(y) == bits(x_np)
    assert same_sharding(y.sharding, x.sharding, 2), y.sharding
    hlo = f.lower(x).compile().as_text()
    assert "jaxvmm_prefetch" in hlo
    # after= ties the reload to one element of z (a scalar broadcast); no array moves.
    assert not [c for c in collectives(hlo) if elements(c) > 1], collectives(hlo)

    # Eager: the ops run as their own jitted programs on the committed sharded array.
    t = jaxvmm.offload(x)
    assert t.sharded and repr(t).endswith("sharded)"), repr(t)
    tok_sharding = t.token.sharding
    assert tok_sharding.spec[:2] == ("a", "b"), tok_sharding
    t = jaxvmm.prefetch(t)
    y = jaxvmm.reload(t)
    assert bits(y) == bits(x_np) and same_sharding(y.sharding, x.sharding, 2)
    # A ticket reloaded twice outside jit raises synchronously (its tickets are checked on every device).
    try:
        jaxvmm.reload(t)
    except jaxvmm.errors.InvalidArgumentError:
        pass
    else:
        raise AssertionError("a second eager reload of a sharded ticket did not raise")

    # A sharded ticket Python drops without reloading frees its host memory on every device.
    s1 = stats(devices)
    t = jaxvmm.offload(x)
    assert delta(s1, stats(devices), "tickets_live") == {d: 1 for d in devices}
    del t
    gc.collect()
    jaxvmm.synchronize()
    s2 = stats(devices)
    assert delta(s1, s2, "tickets_live") == {d: 0 for d in devices}, s2
    assert delta(s0, s2, "errors") == {d: 0 for d in devices}, s2
    jaxvmm.check()


def case_vmap_and_shard_map() -> None:
    """What worked before stays: jax.vmap over a sharded array (one-device calls per element), and
    shard_map bodies (each device's own (2,) token, as before)."""
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices), ("d",))
    x_np = random_bits((8, 6), np.float32, 5)
    x = jax.device_put(x_np, NamedSharding(mesh, P("d")))
    y = jax.jit(jax.vmap(lambda v: jaxvmm.reload(jaxvmm.offload(v))))(x)
    assert bits(y) == bits(x_np)

    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    import inspect

    params = inspect.signature(fn).parameters
    extra = {"check_vma": False} if "check_vma" in params else {"check_rep": False}
    s0 = stats(devices)
    off = jax.jit(fn(jaxvmm.offload, mesh=mesh, in_specs=P("d"), out_specs=P("d"), **extra))
    t = off(x)
    assert not t.sharded and t.token.shape == (8,), t.token.shape  # four (2,) tokens, one per device
    rel = jax.jit(fn(jaxvmm.reload, mesh=mesh, in_specs=P("d"), out_specs=P("d"), **extra))
    y = rel(t)
    assert bits(y) == bits(x_np)
    s1 = stats(devices)
    assert delta(s0, s1, "offloads") == {d: 1 for d in devices}, delta(s0, s1, "offloads")
    jaxvmm.check()


# ---------------------------------------------------------------------------------------------------
# Training steps under plain jit: gradients equal to jax.checkpoint's, offloaded bytes = local shards
# ---------------------------------------------------------------------------------------------------
def _layer(w, h):
    return jnp.tanh(h @ w) + h


def _fsdp_layer(mesh, data_axis):
    """FSDP: weights stored sharded over the data axis, gathered (a sharding constraint) for use."""
    replicated = NamedSharding(mesh, P())

    def layer(w, h):
        w = jax.lax.with_sharding_constraint(w, replicated)
        return jnp.tanh(h @ w) + h

    return layer


def _loss(ckpt, layer, ws, x, scan: bool):
    f = ckpt(layer)
    if scan:
        h, _ = jax.lax.scan(lambda h, w: (f(w, h), None), x, ws)
    else:
        h = x
        for i in range(ws.shape[0]):
            h = f(ws[i], h)
    return jnp.mean(h ** 2)


def check_training_step(mesh, style: str, scan: bool, batch=16, width=64, layers=3, exact=True) -> dict:
    """One sharded training step in plain jit, with jaxvmm.checkpoint and with jax.checkpoint (the
    residuals jaxvmm offloads, saved). Returns what it measured. ``style``: "dp" (batch sharded,
    weights replicated) or "fsdp" (batch and weights sharded over the same axis, weights gathered
    inside each layer). ``exact``: gradients equal bit for bit (else to 1e-5 relative; the GPU
    compiler may fuse the two programs differently)."""
    devices = list(mesh.devices.flat)
    axis = mesh.axis_names[0]
    x = jax.device_put(np.random.default_rng(1).standard_normal((batch, width)).astype(np.float32),
                       NamedSharding(mesh, P(axis)))
    w_np = (np.random.default_rng(2).standard_normal((layers, width, width)) / np.sqrt(width)).astype(np.float32)
    w_spec = P(None, axis) if style == "fsdp" else P()
    ws = jax.device_put(w_np, NamedSharding(mesh, w_spec))
    layer = _fsdp_layer(mesh, axis) if style == "fsdp" else _layer
    names = ("h_in",)

    def tagged(w, h):
        from jax.ad_checkpoint import checkpoint_name

        return layer(w, checkpoint_name(h, "h_in"))

    # The reference saves what jaxvmm offloads: the same residuals, so the same gradients bit for bit
    # (jax's own host offload is not available on every backend).
    jpol = jax.checkpoint_policies.save_only_these_names(*names)
    vpol = jaxvmm.policies.offload_only_these_names(*names)

    def step(ck):
        def go(ws, x):
            loss, g = jax.value_and_grad(lambda ws: _loss(ck, tagged, ws, x, scan))(ws)
            return loss, g, jax.tree.map(lambda w, gw: w - 0.1 * gw, ws, g)
        return jax.jit(go)

    ref = step(lambda f: jax.checkpoint(f, policy=jpol))
    got = step(lambda f: jaxvmm.checkpoint(f, policy=vpol))
    lr, gr, wr = ref(ws, x)
    s0 = stats(devices)
    lg, gg, wg = got(ws, x)
    jax.block_until_ready((lg, gg, wg))
    s1 = stats(devices)
    bitwise = bits(lg) == bits(lr) and bits(gg) == bits(gr) and bits(wg) == bits(wr)
    if exact:
        assert bitwise, (style, scan, float(lg), float(lr), float(jnp.max(jnp.abs(gg - gr))))
    else:
        for a, b in ((lg, lr), (gg, gr), (wg, wr)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert same_sharding(gg.sharding, gr.sharding, 3), (gg.sharding, gr.sharding)
    assert same_sharding(wg.sharding, ws.sharding, 3), (wg.sharding, ws.sharding)

    # Offloaded: the input of every layer, (batch, width) sharded over the batch: each device's
    # offloads add up to layers x its local shard of one activation.
    local_act = batch // len(devices) * width * 4
    offloads = delta(s0, s1, "offloads")
    assert offloads == {d: layers for d in devices}, offloads
    assert delta(s0, s1, "reloads") == offloads, delta(s0, s1, "reloads")
    assert delta(s0, s1, "tickets_live") == {d: 0 for d in devices}, s1
    assert delta(s0, s1, "errors") == {d: 0 for d in devices}, s1

    # The host bytes while the step's tickets are alive: run the forward alone, keeping the tickets.
    fwd = jax.jit(lambda ws, x: jax.vjp(lambda ws: _loss(lambda f: jaxvmm.checkpoint(f, policy=vpol), tagged,
                                                         ws, x, scan), ws))
    s2 = stats(devices)
    loss, vjp_fn = fwd(ws, x)
    s3 = stats(devices)
    held = delta(s2, s3, "ticket_host_bytes")
    assert held == {d: layers * local_act for d in devices}, (held, layers * local_act)
    (g2,) = vjp_fn(jnp.ones_like(loss))  # op by op, outside jit: close to the jitted gradient, not bitwise
    np.testing.assert_allclose(np.asarray(g2), np.asarray(gr), rtol=1e-4, atol=1e-6)
    # The call kept the tickets (the function came out of a jitted program: its call keeps the tokens
    # among its residuals before any reload runs, op by op or in the backward scan, which is compiled;
    # sharded tickets are kept on every device): the VJP function may be called again, and its tickets
    # are freed when it dies.
    assert delta(s2, stats(devices), "tickets_live") == {d: layers for d in devices}
    (g3,) = vjp_fn(jnp.ones_like(loss))
    assert bits(g3) == bits(g2)
    del vjp_fn, g3
    gc.collect()
    assert delta(s2, stats(devices), "tickets_live") == {d: 0 for d in devices}
    hlo = got.lower(ws, x).compile().as_text()
    moved = [c for c in collectives(hlo) if f"f32[{batch}," in c]  # an activation gathered whole
    assert not moved, moved
    jaxvmm.check()
    return {"held_per_device": {dkey(d): v for d, v in held.items()}, "local_activation_bytes": local_act,
            "bitwise_equal": bitwise}


def case_training() -> None:
    devices = jax.devices("cpu")[:4]
    mesh = Mesh(np.array(devices), ("data",))
    shardy = jax.config.jax_use_shardy_partitioner
    for style in ("dp", "fsdp"):
        for scan in ((False, True) if shardy else (True,)):  # GSPMD: the scan form only (compile time)
            check_training_step(mesh, style, scan)
    # A 2-D mesh: batch over "data", the activations' feature dimension over "model".
    mesh2 = Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    x_np = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    x = jax.device_put(x_np, NamedSharding(mesh2, P("data", "model")))
    w = jax.device_put(np.eye(16, dtype=np.float32), NamedSharding(mesh2, P()))
    pol = jaxvmm.policies.offload_everything_saveable(min_bytes=0)
    f = lambda ck: jax.jit(jax.grad(lambda w, x: jnp.sum(ck(lambda w, x: jnp.sin(x @ w) * x)(w, x) ** 2),  # noqa: E731
                                    argnums=(0, 1)))
    got = f(lambda g: jaxvmm.checkpoint(g, policy=pol))(w, x)
    want = f(lambda g: jax.checkpoint(g, policy=jax.checkpoint_policies.everything_saveable))(w, x)
    for a, b in zip(got, want):
        assert bits(a) == bits(b)
        assert same_sharding(a.sharding, b.sharding, 2), (a.sharding, b.sharding)


def case_explicit() -> None:
    """Meshes whose axes are all Explicit (the sharding is part of the type): the ops are shard_maps,
    outputs are typed like the input, tickets cross jits, jaxvmm.checkpoint matches jax.checkpoint."""
    AxisType = getattr(jax.sharding, "AxisType", None)
    set_mesh = getattr(jax, "set_mesh", None) or getattr(jax.sharding, "use_mesh", None)
    if AxisType is None or set_mesh is None:
        print("explicit sharding not in this jax: skipped")
        return
    devices = jax.devices("cpu")[:4]
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2, devices=devices)
    x_np = random_bits((8, 12), np.float32, 9)
    for spec in (P("a", "b"), P(None, "a"), P(("b", "a")), P()):
        x = jax.device_put(x_np, NamedSharding(mesh, spec))
        s0 = stats(devices)
        with set_mesh(mesh):
            f = jax.jit(lambda v: jaxvmm.reload(jaxvmm.offload(v), after=v))
            y = f(x)
            assert bits(y) == bits(x_np) and jax.typeof(y) == jax.typeof(x), (spec, jax.typeof(y), jax.typeof(x))
            assert not [c for c in collectives(f.lower(x).compile().as_text()) if elements(c) > 1], spec
            t = jax.jit(jaxvmm.offload)(x)
            held = delta(s0, stats(devices), "ticket_host_bytes")
            assert sum(held.values()) == x_np.nbytes * _replicas(mesh, spec), (spec, held)
            y = jax.jit(jaxvmm.reload)(jaxvmm.prefetch(t))
            assert bits(y) == bits(x_np) and same_sharding(y.sharding, x.sharding, 2), (spec, y.sharding)
        y = jaxvmm.reload(jaxvmm.offload(x))  # eager
        assert bits(y) == bits(x_np) and same_sharding(y.sharding, x.sharding, 2), (spec, y.sharding)
    assert delta(s0, stats(devices), "tickets_live") == {d: 0 for d in devices}

    x = jax.device_put(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32),
                       NamedSharding(mesh, P("a", "b")))
    w = jax.device_put(np.eye(16, dtype=np.float32) * 0.5, NamedSharding(mesh, P()))
    pol = jaxvmm.policies.offload_everything_saveable(min_bytes=0)
    f = lambda ck: jax.jit(jax.grad(lambda w, x: jnp.sum(ck(lambda w, x: jnp.sin(x @ w) * x)(w, x) ** 2),  # noqa: E731
                                    argnums=(0, 1)))
    with set_mesh(mesh):
        got = f(lambda g: jaxvmm.checkpoint(g, policy=pol))(w, x)
        want = f(lambda g: jax.checkpoint(g, policy=jax.checkpoint_policies.everything_saveable))(w, x)
    for a, b in zip(got, want):
        assert bits(a) == bits(b) and jax.typeof(a) == jax.typeof(b), (jax.typeof(a), jax.typeof(b))
    jaxvmm.check()


CASES = {
    "explicit": case_explicit,
    "roundtrip": case_roundtrip,
    "prefetch_after": case_prefetch_after,
    "vmap_and_shard_map": case_vmap_and_shard_map,
    "training": case_training,
}


if __name__ == "__main__":
    case, partitioner = sys.argv[1], sys.argv[2]
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    assert len(jax.devices("cpu")) >= 4, jax.devices("cpu")
    CASES[case]()
    print(f"{case} OK")
