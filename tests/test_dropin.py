"""Issue #9 item 6: ``jaxvmm.checkpoint`` is a drop-in for ``jax.checkpoint``.

Cases adapted from JAX's own ``jax.checkpoint`` tests (``tests/api_test.py``, ``RematTest``: forward
mode, linearize, vmap, scan/cond, prevent_cse pytrees, ref accumulation, trace caching, saved
residuals), run with ``jaxvmm.checkpoint`` and a policy that really offloads (engine counters say so),
and compared bit for bit with ``jax.checkpoint`` under the policy that saves the same residuals on the
device. ``platform_device`` runs the composition matrix on ``cuda:0`` too (gpu-marked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxvmm
from jaxvmm.remat import _rules

from conftest import assert_trees_bit_equal, assert_trees_ulp_close, counter_delta as delta, engine_counters as estats, jdev

P = jaxvmm.policies
CP = jax.checkpoint_policies
pytestmark = pytest.mark.usefixtures("engine_hygiene")


def fn(x):
    h = checkpoint_name(jnp.cos(x) * x, "h")
    return jnp.sin(h) * x


VMM = functools.partial(jaxvmm.checkpoint, policy=P.offload_only_these_names("h"))
REF = functools.partial(jax.checkpoint, policy=CP.save_only_these_names("h"))


def _sum(f):
    return lambda x: f(x).sum()


# (name, transformation of a function f -> the thing to compute, offloads expected)
COMPOSITIONS = {
    "grad": (lambda f, x: jax.grad(_sum(f))(x), True),
    "jit_grad": (lambda f, x: jax.jit(jax.grad(_sum(f)))(x), True),
    "vjp": (lambda f, x: jax.vjp(f, x)[1](jnp.ones_like(x)), True),
    "jvp": (lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)), False),
    "jit_jvp": (lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (jnp.sin(x),)))(x), False),
    "linearize": (lambda f, x: jax.linearize(f, x)[1](jnp.ones_like(x)), True),
    "jit_linearize": (lambda f, x: jax.jit(lambda x, t: jax.linearize(f, x)[1](t))(x, jnp.ones_like(x)), True),
    "jacfwd": (lambda f, x: jax.jacfwd(f)(x), False),
    "jacrev": (lambda f, x: jax.jacrev(f)(x), True),
    "jit_jacrev": (lambda f, x: jax.jit(jax.jacrev(f))(x), True),
    "hessian": (lambda f, x: jax.hessian(_sum(f))(x), False),
    "jit_hessian": (lambda f, x: jax.jit(jax.hessian(_sum(f)))(x), False),
    "grad_of_grad": (lambda f, x: jax.grad(lambda x: jax.grad(_sum(f))(x).sum())(x), False),
    "hvp": (lambda f, x: jax.jvp(jax.grad(_sum(f)), (x,), (jnp.cos(x),)), False),
    "vmap_grad": (lambda f, x: jax.vmap(jax.grad(_sum(f)))(jnp.stack([x, x * 2])), True),
    "grad_vmap": (lambda f, x: jax.grad(lambda x: jax.vmap(f)(jnp.stack([x, x * 2])).sum())(x), True),
}


@pytest.mark.parametrize("how", sorted(COMPOSITIONS))
def test_compositions_equal_jax_checkpoint(platform_device, how):
    """Every transformation jax.checkpoint composes with: bit-equal results; first-order reverse mode
    and linearize really offload (and reload everything); forward mode has no residuals; second order
    keeps the residuals it differentiates on the device."""
    run, offloads = COMPOSITIONS[how]
    x = jax.device_put(jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32), jdev(platform_device))
    want = run(REF(fn), x)
    before = estats(platform_device)
    got = run(VMM(fn), x)
    assert_trees_bit_equal(got, want)
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    assert d["offloads"] == d["reloads"] and d["errors"] == 0 and d["tickets_live"] == 0, d
    assert (d["offloads"] > 0) == offloads, d


def test_second_order_offloads_what_the_outer_differentiation_does_not_touch():
    """grad of grad w.r.t. w only: the inner residual depends on x alone, so it still leaves."""
    x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32)
    w = jnp.float32(0.5)

    def g(ck):
        inner = lambda w: jax.grad(lambda x: (ck(fn)(x) * w).sum())(x).sum()  # noqa: E731
        return jax.grad(inner)(w)

    before = estats()
    assert_trees_bit_equal(g(VMM), g(REF))
    d = delta(estats(), before)
    assert d["offloads"] == d["reloads"] >= 1 and d["tickets_live"] == 0, d


def test_scan_of_checkpoint_forward_and_reverse():
    def loss(ck, x, ws):
        y, _ = lax.scan(lambda c, w: (ck(lambda c: fn(c * w))(c), None), x, ws)
        return jnp.sum(y * y)

    x = jnp.linspace(-1.0, 1.0, 32, dtype=jnp.float32)
    ws = jnp.linspace(0.5, 1.5, 4, dtype=jnp.float32)
    for f in (lambda ck: jax.jit(jax.grad(functools.partial(loss, ck), argnums=(0, 1))),
              lambda ck: jax.jit(lambda x, ws: jax.jvp(functools.partial(loss, ck), (x, ws), (x, ws)))):
        before = estats()
        # Not bit for bit: on an AVX-512 host (an AMD EPYC CI machine, jax 0.10.2) XLA compiles the
        # reverse scan's arithmetic around the reload differently from around the saved residual, and
        # one element of d/dws differs by 1 ulp (8.6913053e-11 vs 8.6913046e-11); elsewhere it is exact.
        assert_trees_ulp_close(f(VMM)(x, ws), f(REF)(x, ws), ulps=2)
        d = delta(estats(), before)
        assert d["offloads"] == d["reloads"] and d["tickets_live"] == 0, d


def test_checkpoint_of_scan_and_cond():
    """Adapted from test_remat_of_scan / test_remat_of_cond."""
    def scanned(x):
        return lax.scan(lambda c, _: (fn(c), None), x, None, length=3)[0]

    def conded(x):
        return lax.cond(x.sum() > 0, fn, jnp.sin, x)

    x = jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float32)
    for body in (scanned, conded):
        for t in (lambda f: jax.grad(_sum(f))(x), lambda f: jax.linearize(f, x)[1](x), lambda f: jax.jvp(f, (x,), (x,))):
            assert_trees_bit_equal(t(VMM(body)), t(REF(body)))


def test_nested_checkpoints():
    """Adapted from test_remat_nested / the recursive_checkpoint example."""
    inner = VMM(fn)
    outer = jaxvmm.checkpoint(lambda x: inner(jnp.sin(inner(x))), policy=P.offload_everything_saveable(min_bytes=0))
    ref_inner = REF(fn)
    ref_outer = jax.checkpoint(lambda x: ref_inner(jnp.sin(ref_inner(x))), policy=CP.everything_saveable)
    x = jnp.linspace(-1.0, 1.0, 16, dtype=jnp.float32)
    for t in (lambda f: jax.grad(_sum(f))(x), lambda f: jax.jit(jax.grad(_sum(f)))(x), lambda f: jax.jacfwd(f)(x)):
        assert_trees_bit_equal(t(outer), t(ref_outer))


def test_keyword_arguments_static_argnames_and_fun_name():
    def f(x, *, scale, flip):
        return (jnp.sin(x) if flip else jnp.cos(x)) * scale

    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    ck = jaxvmm.checkpoint(fun=f, static_argnames="flip", policy=P.offload_everything_saveable(min_bytes=0))
    for flip in (True, False):
        got = jax.jvp(lambda x: ck(x, scale=jnp.float32(2.0), flip=flip), (x,), (x,))
        want = jax.jvp(lambda x: f(x, scale=jnp.float32(2.0), flip=flip), (x,), (x,))
        assert_trees_bit_equal(got, want)
        assert_trees_bit_equal(jax.grad(lambda s: ck(x, scale=s, flip=flip).sum())(jnp.float32(2.0)),
                          jax.grad(lambda s: f(x, scale=s, flip=flip).sum())(jnp.float32(2.0)))


def test_prevent_cse_pytree_like_jax():
    """Adapted from test_remat_partial_cse_prevention_pytree: the barrier keeps only what is asked."""
    def layer(ck):
        return ck(lambda dct: dct["x"] @ dct["W"], prevent_cse=({"W": False, "x": True},))

    def loss(ck, Ws, x):
        for W in Ws:
            x = layer(ck)(dict(W=W, x=x))
        return jnp.sum(x ** 2)

    Ws = [jnp.ones((3, 3)) for _ in range(2)]
    x = jnp.ones(3)
    txt = jax.jit(jax.grad(functools.partial(loss, jaxvmm.checkpoint), (0, 1))).lower(Ws, x).as_text()
    assert "optimization_barrier" in txt
    assert_trees_bit_equal(jax.grad(functools.partial(loss, jaxvmm.checkpoint), (0, 1))(Ws, x),
                      jax.grad(functools.partial(loss, jax.checkpoint), (0, 1))(Ws, x))


def test_effects_jax_checkpoint_allows(capfd):
    def f(x):
        jax.debug.print("seen {}", x[0])
        return fn(x)

    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    before = estats()
    assert_trees_bit_equal(jax.grad(_sum(VMM(f)))(x), jax.grad(_sum(REF(f)))(x))
    jax.effects_barrier()
    assert "seen -1" in capfd.readouterr().out
    d = delta(estats(), before)
    assert d["offloads"] == d["reloads"] == 1, d


@pytest.mark.skipif(not hasattr(jax, "ref"), reason="jax.ref needs a newer jax")
def test_vjp_with_refs_accumulates_like_jax():
    """Adapted from test_remat_grad_accum_refs."""
    f = jaxvmm.checkpoint(jnp.sin, policy=P.offload_everything_saveable(min_bytes=0))
    p = jnp.linspace(0.0, 2.0, 8, dtype=jnp.float32)
    _, vjp_fn = jax.vjp(f, p)
    acc = jax.ref.new_ref(jnp.zeros_like(p))
    vjp_fn.with_refs(acc)(jnp.ones_like(p))
    assert_trees_bit_equal(jax.ref.get(acc), jax.grad(lambda p: jax.checkpoint(jnp.sin)(p).sum())(p))


@pytest.mark.skipif(not hasattr(jax, "ref"), reason="jax.ref needs a newer jax")
def test_ref_closed_over_in_scan_body():
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)

    def run(ck):
        @jax.jit
        def go(x):
            r = jax.ref.new_ref(jnp.zeros_like(x))

            def body(c, _):
                y = ck(fn)(c)
                r[...] += y
                return y, None

            c, _ = lax.scan(body, x, None, length=3)
            return c, jax.ref.get(r)

        return go(x), jax.jvp(lambda x: go(x), (x,), (x,))

    assert_trees_bit_equal(run(VMM), run(REF))


def test_eager_calls_trace_once_like_jax_checkpoint():
    """Adapted from test_fwd_caching: repeated eager calls (and jax.vjp) reuse JAX's trace cache."""
    counts = {"vmm": 0, "jax": 0}

    def make(key):
        def f(x):
            counts[key] += 1
            return fn(x)
        return f

    vmm, ref = VMM(make("vmm")), REF(make("jax"))
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
    for _ in range(10):
        vmm(x).block_until_ready()
        ref(x).block_until_ready()
    assert counts["vmm"] == counts["jax"] == 1, counts
    for _ in range(5):
        jax.vjp(vmm, x)[1](x)
        jax.vjp(ref, x)[1](x)
    assert counts["vmm"] == counts["jax"], counts
    s = jaxvmm.checkpoint(lambda x, k: fn(x) * k, static_argnums=1)
    calls = []
    s2 = jaxvmm.checkpoint(lambda x, *, k: calls.append(1) or fn(x) * k, static_argnames="k")
    for _ in range(5):
        s(x, 2.0)
        s2(x, k=2.0)
    assert len(calls) == 1, calls


def test_saved_residuals_names_what_the_policy_offloaded(capsys):
    def f(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "hidden")
        k = checkpoint_name(jnp.sin(x @ w), "kept")
        return (h * k).sum()

    pol = P.save_and_offload_only_these_names(names_which_can_be_saved=["kept"], names_which_can_be_offloaded=["hidden"])
    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    res = jaxvmm.saved_residuals(jaxvmm.checkpoint(f, policy=pol), x, w)
    whats = [w for _, w in res]
    offloaded = [(a, w) for a, w in res if w.startswith("offloaded through jaxvmm: named 'hidden'")]
    assert len(offloaded) == 1 and offloaded[0][0].shape == (8, 16), whats
    jaxvmm.print_saved_residuals(jaxvmm.checkpoint(f, policy=pol), x, w)
    assert "f32[8,16] offloaded through jaxvmm: named 'hidden'" in capsys.readouterr().out


@pytest.mark.parametrize("around", ["none", "jit", "scan"])
def test_jax_saved_residuals_lists_an_offloaded_residual_as_its_array(around):
    """JAX's own ``saved_residuals`` (``jax.ad_checkpoint.print_saved_residuals``, RematTest's
    test_name_* cases) on a ``jaxvmm.checkpoint``: the list ``jax.checkpoint`` gives with the policy that
    saves the same values, in JAX's words, the offloaded one marked; no ``u32[2]`` token, no ``f32[2]``
    shadow (before: the token, described as an output of ``custom_jvp_call``, then its shadow)."""
    from jax._src.ad_checkpoint import saved_residuals as jax_saved_residuals

    def f(x, w):
        h = checkpoint_name(jnp.tanh(x @ w), "hidden")
        k = checkpoint_name(jnp.sin(x @ w), "kept")
        return (h * k).sum()

    def make(ckpt, policy):
        g = ckpt(f, policy=policy)
        if around == "jit":
            return jax.jit(g)
        if around == "scan":
            return lambda x, w: lax.scan(lambda c, _: (g(c, w) * c, None), x, None, length=2)[0].sum()
        return g

    x, w = jnp.ones((8, 16)), jnp.ones((16, 16))
    pol = P.save_and_offload_only_these_names(names_which_can_be_saved=["kept"], names_which_can_be_offloaded=["hidden"])
    vmm = jax_saved_residuals(make(jaxvmm.checkpoint, pol), x, w)
    ref = jax_saved_residuals(make(jax.checkpoint, CP.save_only_these_names("kept", "hidden")), x, w)
    mark = ", offloaded through jaxvmm"
    assert [a for a, _ in vmm] == [a for a, _ in ref], (vmm, ref)
    assert [d.removesuffix(mark) for _, d in vmm] == [d for _, d in ref], (vmm, ref)
    moved = [(a, d) for a, d in vmm if d.endswith(mark)]
    assert len(moved) == 1, vmm
    if around == "none":
        assert moved[0][0].shape == (8, 16) and moved[0][1].startswith("named 'hidden' from "), moved


import contextlib


@contextlib.contextmanager
def _remat3_flag():
    from jax._src import config

    with config.remat3(True):
        yield


class TestErrors:
    """Item 7: misuse gives a jaxvmm: error naming the argument and the fix."""

    def test_remat3_is_refused_with_the_fix(self):
        """With ``jax_remat3=True`` jax.checkpoint takes a path jaxvmm does not hook: before, a policy that
        offloads silently offloaded nothing (jax.checkpoint's values, no memory saved); now it is refused,
        naming the flag and the fix. policy=None (nothing to offload) still works, like jax.checkpoint."""
        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
        with _remat3_flag():
            with pytest.raises(jaxvmm.errors.NotSupportedError, match=r"^jaxvmm\.checkpoint: jax_remat3=True .*"
                               r"jax\.config\.update\('jax_remat3', False\)"):
                VMM(fn)
            g = jax.grad(_sum(jaxvmm.checkpoint(fn)))(x)
        assert_trees_bit_equal(g, jax.grad(_sum(jax.checkpoint(fn)))(x))
        assert jax.grad(_sum(VMM(fn)))(x).shape == x.shape  # off again: accepted

    def test_vjp_function_returned_by_a_jitted_program_first_called_as_an_argument_names_the_fix(self, monkeypatch):
        """A JAX whose VJP object jaxvmm cannot hook (simulated: the construction hook taken off): a VJP
        function that a jitted program returned, first called inside another jitted program that takes it
        as an argument (its residuals are traced there), consumes its tickets; calling it again eagerly is
        refused with the fix."""
        from jax._src import api

        monkeypatch.setattr(api.VJP, "__init__", api.VJP.__init__.__wrapped_by_jaxvmm__)
        x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)
        _, vjp_fn = jax.jit(lambda x: jax.vjp(VMM(fn), x))(x)
        _, ref_fn = jax.jit(lambda x: jax.vjp(REF(fn), x))(x)
        apply = jax.jit(lambda f, ct: f(ct))
        assert_trees_bit_equal(apply(vjp_fn, jnp.ones_like(x)), apply(ref_fn, jnp.ones_like(x)))
        jaxvmm.synchronize()
        with pytest.raises(jaxvmm.InvalidArgumentError, match=r"jaxvmm\.checkpoint: this VJP or linearized function "
                                                             r"was already called once.*compiled program that returned "
                                                             r"the function itself.*took the function as an argument.*"
                                                             r"Call the function itself first"):
            vjp_fn(jnp.ones_like(x))

    def test_check_names_the_call_site_and_the_ticket_of_a_bad_reload_inside_jit(self):
        """A ticket reloaded twice inside jit: jaxvmm.check() names the ticket and the Python line of
        the reload that consumed it a second time."""
        x = jnp.ones(1024, jnp.float32)
        t = jaxvmm.offload(x)

        @jax.jit
        def again(tok):
            return jaxvmm.reload(jaxvmm.Ticket(tok, (1024,), jnp.float32))  # the line check() names

        line = again.__wrapped__.__code__.co_firstlineno + 2  # the decorator line, the def, then the reload
        assert_trees_bit_equal(again(t.token), x)
        again(t.token).block_until_ready()
        jaxvmm.synchronize()
        with pytest.raises(jaxvmm.VmmError, match=rf"ticket \d+ was already reloaded.*\[call site \d+: reload at "
                                                  rf".*test_dropin\.py:{line} \(again\)\]"):
            jaxvmm.check()

    def test_fn_keyword_is_named(self):
        with pytest.raises(TypeError, match=r"jaxvmm\.checkpoint: unsupported keyword argument fn=.*named fun"):
            jaxvmm.checkpoint(fn=jnp.sin)

    def test_static_argnames_of_wrong_type(self):
        with pytest.raises(jaxvmm.InvalidArgumentError, match=r"jaxvmm\.checkpoint: static_argnames must be"):
            jaxvmm.checkpoint(jnp.sin, static_argnames=[1])

    def test_prevent_cse_pytree_of_non_bools(self):
        with pytest.raises(jaxvmm.InvalidArgumentError, match=r"jaxvmm\.checkpoint: prevent_cse must be a bool"):
            jaxvmm.checkpoint(jnp.sin, prevent_cse=({"a": 1},))


def test_second_order_of_checkpointed_cond_equals_jax():
    """Adapted from test_remat_of_cond (check_grads order 2, reverse mode) with every saved value
    offloaded: the offload's ordering tie must not give a residual a derivative."""
    f = lambda x: lax.cond(x > 0.0, lambda c: (jnp.sin(c), jnp.cos(c)), lambda c: (jnp.cos(c), c), x)  # noqa: E731
    vmm = jaxvmm.checkpoint(f, policy=P.offload_everything_saveable(min_bytes=0))
    ref = jax.checkpoint(f, policy=CP.everything_saveable)

    def second(ck):
        def f_vjp(x):
            out, vjp_fn = jax.vjp(ck, x)
            return vjp_fn(out)
        return jax.vjp(f_vjp, 3.0)[1]((1.0,))

    assert_trees_bit_equal(second(vmm), second(ref))


def test_excess_precision_residual_equals_primal_use():
    """Adapted from test_excess_precision_hell: an offloaded bf16 residual is rounded where it is
    made, so the backward pass sees exactly what the forward pass used."""
    eps = jnp.finfo("bfloat16").eps

    @jax.custom_vjp
    def dot(x):
        return jnp.dot(x, x)

    dot.defvjp(lambda x: (dot(x), None), lambda _, g: (g,))

    @jax.custom_vjp
    def widen(x):
        return jnp.float32(1.0) * x.astype("float32")

    widen.defvjp(lambda x: (widen(x), x), lambda x, _: (jnp.float32(1.0) * x.astype("float32"),))

    f = jax.jit(jaxvmm.checkpoint(lambda x: widen(dot(x)), policy=P.offload_everything_saveable(min_bytes=0)))
    x = (jnp.bfloat16(1) + eps) * jnp.eye(2, dtype="bfloat16")
    before = estats()
    y, vjp_fn = jax.vjp(f, x)
    (y_,) = vjp_fn(jnp.ones_like(y))
    assert_trees_bit_equal(y_, y)
    assert delta(estats(), before)["offloads"] >= 1


# ---- a VJP / linearized function called more than once (its tickets are kept, freed when it dies) ----
def _x(device="cpu", n=64):
    return jax.device_put(jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32), jdev(device))


def _equal_jitted(got, want, device):
    """Results of two different jitted programs: bit for bit on cpu (checked there); on a GPU, where XLA
    may fold or fuse the program that saves on the device differently (a residual that is a constant
    of the program is folded on the host), within 2 ulp."""
    if device == "cpu":
        assert_trees_bit_equal(got, want)
        return
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2.5e-7, atol=1e-6)


def test_vjp_function_called_three_times_equals_jax_checkpoint_and_frees_on_del(platform_device):
    import gc

    x = _x(platform_device)
    cts = [jnp.cos(x) * (i + 1) for i in range(3)]
    _, ref_fn = jax.vjp(REF(fn), x)
    want = [ref_fn(c) for c in cts]
    before = estats(platform_device)
    _, vjp_fn = jax.vjp(VMM(fn), x)
    got = [vjp_fn(c) for c in cts]
    for g, w in zip(got, want):
        assert_trees_bit_equal(g, w)
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    # one offload, reloaded by each of the three calls; the ticket lives while vjp_fn does
    assert d["offloads"] == 1 and d["reloads"] == 3 and d["tickets_live"] == 1 and d["errors"] == 0, d
    del vjp_fn, got
    gc.collect()
    d = delta(estats(platform_device), before)
    assert d["tickets_live"] == 0 and d["ticket_host_bytes"] == 0, d


def test_linearized_function_called_twice(platform_device):
    import gc

    x = _x(platform_device)
    before = estats(platform_device)
    y, lin = jax.linearize(VMM(fn), x)
    y_ref, lin_ref = jax.linearize(REF(fn), x)
    assert_trees_bit_equal(y, y_ref)
    for t in (jnp.ones_like(x), jnp.sin(x)):
        assert_trees_bit_equal(lin(t), lin_ref(t))
    d = delta(estats(platform_device), before)
    assert d["offloads"] == 1 and d["reloads"] == 2 and d["tickets_live"] == 1, d
    del lin
    gc.collect()
    assert delta(estats(platform_device), before)["tickets_live"] == 0


def test_jit_of_vjp_function_called_twice(platform_device):
    """jax.jit(vjp_fn): the residual tokens are constants of the jitted program; every call reloads."""
    import gc

    x = _x(platform_device)
    before = estats(platform_device)
    _, vjp_fn = jax.vjp(VMM(fn), x)
    _, ref_fn = jax.vjp(REF(fn), x)
    jitted, ref_jitted = jax.jit(vjp_fn), jax.jit(ref_fn)
    outs = [jitted(c) for c in (jnp.ones_like(x), jnp.cos(x), jnp.ones_like(x))]
    assert_trees_bit_equal(outs[0], outs[2])  # the same call twice: the same reload, the same bits
    for out, c in zip(outs, (jnp.ones_like(x), jnp.cos(x), jnp.ones_like(x))):
        _equal_jitted(out, ref_jitted(c), platform_device)
    assert_trees_bit_equal(vjp_fn(jnp.sin(x)), ref_fn(jnp.sin(x)))  # and eagerly after the jitted calls
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    assert d["offloads"] == 1 and d["reloads"] == 4 and d["errors"] == 0, d
    del vjp_fn, jitted
    gc.collect()
    assert delta(estats(platform_device), before)["tickets_live"] == 0


def test_uncalled_vjp_function_frees_its_tickets_when_it_dies():
    import gc

    x = _x()
    before = estats()
    _, vjp_fn = jax.vjp(VMM(fn), x)
    assert delta(estats(), before)["tickets_live"] == 1
    del vjp_fn
    gc.collect()
    assert delta(estats(), before)["tickets_live"] == 0


def test_training_loops_do_not_leak_tickets(platform_device):
    """A jitted step (tickets made and consumed inside the program) and an eager one (tickets kept,
    freed as each step's VJP function dies): ten steps each, no ticket left, same parameters as
    jax.checkpoint's."""
    x = _x(platform_device, 32)
    w0 = jax.device_put(jnp.full((32,), 0.5, jnp.float32), jdev(platform_device))

    def loss(ck, w):
        return (ck(fn)(x * w) ** 2).sum()

    for wrap in (jax.jit, lambda f: f):
        before = estats(platform_device)
        steps = {}
        for name, ck in (("vmm", VMM), ("ref", REF)):
            step = wrap(lambda w, ck=ck: w - 0.01 * jax.grad(functools.partial(loss, ck))(w))
            w = w0
            for _ in range(10):
                w = step(w)
            steps[name] = w
        _equal_jitted(steps["vmm"], steps["ref"], platform_device)
        jaxvmm.check()
        d = delta(estats(platform_device), before)
        assert d["offloads"] == d["reloads"] == 10 and d["tickets_live"] == 0 and d["errors"] == 0, d


# ---- second derivatives taken from outside a staged first derivative ----
# (forward mode over it: the tangent of an offloaded residual is offloaded with it and reloaded with it)
STAGED_SECOND_ORDER = {
    "hessian_of_jit": lambda f, x: jax.hessian(jax.jit(_sum(f)))(x),
    "jit_hessian_of_jit": lambda f, x: jax.jit(jax.hessian(jax.jit(_sum(f))))(x),
    "jacfwd_of_jit_grad": lambda f, x: jax.jacfwd(jax.jit(jax.grad(_sum(f))))(x),
    "hvp_of_jit_grad": lambda f, x: jax.jvp(jax.jit(jax.grad(_sum(f))), (x,), (jnp.cos(x),)),
}


@pytest.mark.parametrize("how", sorted(STAGED_SECOND_ORDER))
def test_forward_over_a_staged_first_derivative_equals_jax_checkpoint(platform_device, how):
    run = STAGED_SECOND_ORDER[how]
    x = _x(platform_device, 16)
    want = run(REF(fn), x)
    before = estats(platform_device)
    got = run(VMM(fn), x)
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    if how == "hvp_of_jit_grad":
        # One jitted program whose tangent flows through a reload in one and is fused with its producer
        # in the other: XLA may round the fused arithmetic differently (1 ulp seen on cpu).
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
        tangents = 1
    else:
        _equal_jitted(got, want, platform_device)
        tangents = x.size  # jacfwd: one tangent per basis vector, each offloaded with the residual
    # the residual once, and its tangent(s), each offloaded and reloaded once; nothing left
    assert d["offloads"] == d["reloads"] == 1 + tangents and d["tickets_live"] == 0 and d["errors"] == 0, d


def test_hessian_of_a_jitted_scan_and_cond_of_checkpoints_equals_jax():
    def scanned(ck, x):
        y, _ = lax.scan(lambda c, w: (ck(lambda c: fn(c * w))(c), None), x, jnp.linspace(0.5, 1.5, 3))
        return (y * y).sum()

    def conded(ck, x):
        return lax.cond(x.sum() > 0, ck(fn), jnp.sin, x).sum()

    x = _x("cpu", 8)
    for loss in (scanned, conded):
        before = estats()
        got = jax.hessian(jax.jit(functools.partial(loss, VMM)))(x)
        # Within 2 ulps, not bit for bit: with jax 0.12 one element of the scan case's hessian differs by
        # 1 ulp (XLA compiles the arithmetic around the reload differently); jax 0.10 and 0.11 are exact.
        assert_trees_ulp_close(got, jax.hessian(jax.jit(functools.partial(loss, REF)))(x), ulps=2)
        jaxvmm.check()
        d = delta(estats(), before)
        assert d["offloads"] == d["reloads"] > 1 and d["tickets_live"] == 0, d


def test_check_grads_of_a_jitted_checkpoint_forward_order_two():
    from jax._src import test_util as jtu

    jtu.check_grads(jax.jit(_sum(VMM(fn))), (_x("cpu", 8),), order=2, modes=["fwd"])


REVERSE_OVER_STAGED = {
    "grad_of_jit_grad": lambda f, x: jax.grad(lambda x: jax.jit(jax.grad(_sum(f)))(x).sum())(x),
    "jit_grad_of_jit_grad": lambda f, x: jax.jit(jax.grad(lambda x: jax.jit(jax.grad(_sum(f)))(x).sum()))(x),
    "jacrev_of_jit_grad": lambda f, x: jax.jacrev(jax.jit(jax.grad(_sum(f))))(x),
    "vjp_of_jit_vjp": lambda f, x: jax.vjp(lambda x: jax.jit(lambda x: jax.vjp(f, x)[1](jnp.sin(x)))(x), x)[1](
        (jnp.cos(x),)),
}


@pytest.mark.parametrize("how", sorted(REVERSE_OVER_STAGED))
def test_reverse_over_a_staged_first_derivative_equals_jax_checkpoint(platform_device, how):
    """The outer reverse pass offloads the cotangent of each reloaded residual where the reload was and
    reloads it where the offload was (the two tangent primitives are each other's transpose)."""
    run = REVERSE_OVER_STAGED[how]
    x = _x(platform_device, 16)
    want = run(REF(fn), x)
    before = estats(platform_device)
    got = run(VMM(fn), x)
    _equal_jitted(got, want, platform_device)
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    assert d["offloads"] == d["reloads"] >= 2 and d["tickets_live"] == 0 and d["errors"] == 0, d


def test_check_grads_of_a_jitted_checkpoint_order_two_both_modes():
    from jax._src import test_util as jtu

    x = _x("cpu", 8)
    before = estats()
    jtu.check_grads(jax.jit(_sum(VMM(fn))), (x,), order=2, modes=["fwd", "rev"])
    jaxvmm.check()
    d = delta(estats(), before)
    assert d["offloads"] == d["reloads"] > 2 and d["tickets_live"] == 0, d


def test_tangent_ticket_evaluated_eagerly_lives_while_its_float_token_does():
    """The tangent primitives evaluated outside any trace: the ticket's token exists only as float32
    bits; the lifetime registry must read them as the token (not drop the ticket when the uint32 array
    that the offload made dies), and free it once the float array dies."""
    import gc

    x = _x("cpu", 32)
    before = estats()
    t = _rules.tangent_offload_p.bind(x)
    assert t.dtype == jnp.float32 and t.shape == (2,)
    gc.collect()
    jaxvmm.offload(jnp.ones(8)).token.block_until_ready()  # another offload runs the registry's collection
    jaxvmm.synchronize()
    assert_trees_bit_equal(_rules.tangent_reload_p.bind(t, shape=(32,), dtype=np.dtype(np.float32)), x)
    t2 = _rules.tangent_offload_p.bind(x * 2)
    del t2  # never reloaded: freed when its float token dies
    gc.collect()
    d = delta(estats(), before)
    assert d["tickets_live"] == 0 and d["errors"] == 0, d


# ---- a VJP / linearized function whose forward ran inside a compiled program, called more than once ----
# (the tokens its residuals hold come out of that program: they are kept when jax.vjp / jax.linearize
# hands them over, and freed when the function dies)
def _scan_loss(ck, x):
    y, _ = lax.scan(lambda c, w: (ck(lambda c: fn(c * w))(c), None), x, jnp.linspace(0.5, 1.5, 3))
    return (y * y).sum()


def _vjp_any_number_of_times(platform_device, make, cts, offloads):
    """``make(ck)`` -> a VJP or linearized function; each cotangent of ``cts`` under jax.jit (twice), eagerly
    (twice), under jax.jit again: every call equals jax.checkpoint's (bit for bit; jitted: see
    _equal_jitted), the same call gives the same bits, the tickets live while the function does and are
    freed when it dies."""
    import gc

    ref_fn = make(REF)
    ref_jitted = jax.jit(ref_fn)
    before = estats(platform_device)
    vjp_fn = make(VMM)
    jitted = jax.jit(vjp_fn)
    calls = 0
    for ct in cts:
        j1 = jitted(ct)  # first under jax.jit: its tracing (before any reload runs) keeps the tickets too
        assert_trees_bit_equal(jitted(ct), j1)
        _equal_jitted(j1, ref_jitted(ct), platform_device)
        first = vjp_fn(ct)
        assert_trees_bit_equal(first, ref_fn(ct))
        assert_trees_bit_equal(vjp_fn(ct), first)
        assert_trees_bit_equal(jitted(ct), j1)  # jitted again after the eager calls
        calls += 5
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    assert d["offloads"] == offloads and d["reloads"] == offloads * calls, d
    assert d["tickets_live"] == offloads and d["errors"] == 0, d
    del vjp_fn, jitted
    gc.collect()
    d = delta(estats(platform_device), before)
    assert d["tickets_live"] == 0 and d["ticket_host_bytes"] == 0, d


def test_the_jax_functions_jaxvmm_hooks_are_hooked():
    """jax 0.11 renamed a parameter of the functions a VJP/linearized function calls (out_known ->
    out_zeros) and moved the linear jaxpr's residuals from constvars to invars: the hooks then silently
    stayed off and the second call of such a function read a consumed ticket (0xFF, an error)."""
    from jax._src.interpreters import ad

    from jaxvmm.remat import _rules

    from jax._src import api, tree_util

    assert ad.linearize is _rules._linearize
    assert _rules.api_hooks_installed() == {"_vjp3_callable": True, "_lift_linearized": True}
    assert getattr(api.VJP.__init__, "__wrapped_by_jaxvmm__", None) is not None
    assert getattr(tree_util.Partial.__new__, "__wrapped_by_jaxvmm__", None) is not None


def test_vjp_function_of_a_jitted_forward_called_any_number_of_times(platform_device):
    x = _x(platform_device)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.vjp(jax.jit(ck(fn)), x)[1],
                             [jnp.ones_like(x), jnp.cos(x)], offloads=1)


def test_vjp_function_over_a_scan_of_checkpoints_called_any_number_of_times(platform_device):
    """lax.scan is compiled even outside jit: its forward's tickets come out of the scan as stacked
    tokens (one per iteration)."""
    x = _x(platform_device, 8)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.vjp(functools.partial(_scan_loss, ck), x)[1],
                             [jnp.float32(1.0), jnp.float32(-0.5)], offloads=3)


def test_linearized_function_of_a_jitted_forward_called_any_number_of_times(platform_device):
    x = _x(platform_device)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.linearize(jax.jit(ck(fn)), x)[1],
                             [jnp.ones_like(x), jnp.sin(x)], offloads=1)


def test_vjp_function_returned_by_a_jitted_program_called_any_number_of_times(platform_device):
    """jax.vjp inside jax.jit, the VJP function returned (a pytree): its tokens come out of that program;
    they are kept when the function is first called (here: traced by jax.jit(vjp_fn))."""
    x = _x(platform_device)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.jit(lambda x: jax.vjp(ck(fn), x))(x)[1],
                             [jnp.ones_like(x), jnp.cos(x)], offloads=1)


def test_vjp_function_of_a_scan_returned_by_a_jitted_program_called_any_number_of_times(platform_device):
    x = _x(platform_device, 8)
    _vjp_any_number_of_times(
        platform_device, lambda ck: jax.jit(lambda x: jax.vjp(functools.partial(_scan_loss, ck), x))(x)[1],
        [jnp.float32(1.0)], offloads=3)


def test_linearized_function_returned_by_a_jitted_program_called_any_number_of_times(platform_device):
    x = _x(platform_device)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.jit(lambda x: jax.linearize(ck(fn), x))(x)[1],
                             [jnp.sin(x)], offloads=1)


def test_vjp_function_of_a_jitted_scan_called_any_number_of_times(platform_device):
    x = _x(platform_device, 8)
    _vjp_any_number_of_times(platform_device, lambda ck: jax.vjp(jax.jit(functools.partial(_scan_loss, ck)), x)[1],
                             [jnp.float32(1.0)], offloads=3)


def test_eager_training_loops_over_compiled_forwards_do_not_leak_tickets(platform_device):
    """jax.grad of a jitted loss and eager jax.grad over lax.scan: each step's tickets are kept (its VJP
    function could be called again) and freed once the step's VJP function has died; nothing is left
    after any step, and the parameters equal jax.checkpoint's."""
    x = _x(platform_device, 8)

    def jitted_loss(ck):
        return jax.jit(lambda w: (ck(fn)(x * w) ** 2).sum())

    def scan_loss(ck):
        return lambda w: _scan_loss(ck, x * w)

    for make, per_step in ((jitted_loss, 1), (scan_loss, 3)):
        w0 = jax.device_put(jnp.full((8,), 0.5, jnp.float32), jdev(platform_device))
        ws = {}
        for name, ck in (("ref", REF), ("vmm", VMM)):
            grad = jax.grad(make(ck))
            before = estats(platform_device)
            w = w0
            for _ in range(4):
                w = w - 0.01 * grad(w)
                d = delta(estats(platform_device), before)
                assert d["tickets_live"] == 0 and d["errors"] == 0, d
            ws[name] = w
            if name == "vmm":
                assert d["offloads"] == d["reloads"] == 4 * per_step, d
        _equal_jitted(ws["vmm"], ws["ref"], platform_device)


def test_kept_residual_tokens_are_only_those_a_reload_reads():
    """The residuals kept are the tokens a reload of the linear function reads, not every array shaped
    like one: the float32[2] shadow that travels with a token and a user's float32[2] residuals are not."""
    import unittest.mock

    x = _x("cpu", 8)

    def f(x):
        h = jax.jit(VMM(fn))(x)
        return jax.jit(lambda h: h[:2] * h[2:4] * h[4])(h)

    seen = []
    orig = _rules._jax_linearize

    def spy(*a, **k):
        out = orig(*a, **k)
        seen.append((out[2], out[3]))
        return out

    with unittest.mock.patch.object(_rules, "_jax_linearize", spy):
        jax.vjp(f, x)
    (jaxpr, consts), = seen
    tokens = _rules._residual_tokens(jaxpr, consts)
    shaped = [c for c in consts if c.ndim >= 1 and c.shape[-1] == 2]
    assert len(tokens) == 1 and tokens[0].dtype == jnp.uint32, (tokens, shaped)
    assert len(shaped) >= 3, shaped  # the token, its shadow, h[:2] and h[2:4]: the test can fail


def test_the_hooks_that_keep_residual_tokens_are_installed():
    """The JAX functions jaxvmm wraps to keep the tokens among a VJP function's residuals exist in this JAX
    with the parameters jaxvmm expects (else those functions are single use again: this says why)."""
    from jax._src import api
    from jax._src.interpreters import ad

    assert ad.linearize is _rules._linearize
    for name in _rules._API_HOOKS:
        assert getattr(getattr(api, name), "__wrapped_by_jaxvmm__", None) is not None, name


@pytest.mark.parametrize("kind", ["vjp", "linearize"])
def test_function_returned_by_a_jitted_program_first_called_inside_another_jitted_program(platform_device, kind):
    """The VJP (or linearized) function a jitted program returns, passed as an argument to another jitted
    program for its first call (its residuals are tracers there): before, that call consumed the tickets
    and a later call failed ("already reloaded"). Its tokens are now kept when the function is rebuilt
    from the first program's outputs; every call equals jax.checkpoint's, and the tickets are freed when
    the function dies."""
    import gc

    x = _x(platform_device)
    if kind == "vjp":
        make = lambda ck: jax.jit(lambda x: jax.vjp(ck(fn), x))(x)[1]  # noqa: E731
    else:
        make = lambda ck: jax.jit(lambda x: jax.linearize(ck(fn), x))(x)[1]  # noqa: E731
    apply = jax.jit(lambda f, ct: f(ct))
    ref = make(REF)
    before = estats(platform_device)
    f = make(VMM)
    for ct in [jnp.ones_like(x), jnp.cos(x)]:
        want = apply(ref, ct)
        got = apply(f, ct)  # traced with f as an argument: the residual tokens are its inputs
        _equal_jitted(got, want, platform_device)
        assert_trees_bit_equal(apply(f, ct), got)
        assert_trees_bit_equal(f(ct), ref(ct))
        assert_trees_bit_equal(apply(f, ct), got)
    jaxvmm.check()
    d = delta(estats(platform_device), before)
    assert d["tickets_live"] == 1 and d["errors"] == 0 and d["reloads"] == 8, d
    del f
    gc.collect()
    d = delta(estats(platform_device), before)
    assert d["tickets_live"] == 0 and d["ticket_host_bytes"] == 0, d
