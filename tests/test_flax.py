"""jaxvmm.flax: the linen lifted transform (like nn.remat, under nn.scan too) and the NNX helper (like
nnx.remat) give parameters and gradients bit-identical to flax's own remat with the policy that saves
the same values, with one offload and one reload per layer and step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

import jaxvmm

from conftest import drain_errors, engine_counters

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")
import jaxvmm.flax as jf  # noqa: E402  (after the flax skip)

CP = jax.checkpoint_policies
P = jaxvmm.policies
L = 3


@pytest.fixture(autouse=True)
def _engine_hygiene():
    drain_errors(collect=False)
    yield
    drain_errors()


def counts():
    """Offloads, reloads and live tickets of every engine (the default device is cpu in CI, cuda:0 on a GPU runner)."""
    s = engine_counters()
    return s["offloads"], s["reloads"], s["tickets_live"]


def assert_bit_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert np.array_equal(np.asarray(x), np.asarray(y))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = checkpoint_name(nn.gelu(nn.Dense(4 * x.shape[-1])(x)), "hidden")
        x = nn.Dropout(0.1, deterministic=False)(x)
        return x + nn.Dense(x.shape[-1])(h), None


def _stack(remat, policy):
    return nn.scan(remat(Block, policy=policy), variable_axes={"params": 0},
                   split_rngs={"params": True, "dropout": True}, length=L)()


def test_linen_remat_under_scan_bit_equal_to_nn_remat():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32))
    ref, vmm = _stack(nn.remat, CP.save_only_these_names("hidden")), _stack(jf.remat, P.offload_only_these_names("hidden"))
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    p_ref, p_vmm = ref.init(keys, x, None), vmm.init(keys, x, None)
    assert_bit_equal(p_vmm, p_ref)

    def grad(m):
        return jax.jit(jax.value_and_grad(
            lambda p, x: jnp.sum(m.apply(p, x, None, rngs={"dropout": jax.random.key(2)})[0] ** 2)))

    want = grad(ref)(p_ref, x)
    o0, r0, t0 = counts()
    got = grad(vmm)(p_vmm, x)
    o1, r1, t1 = counts()
    assert_bit_equal(got, want)
    assert (o1 - o0, r1 - r0, t1 - t0) == (L, L, 0)
    jaxvmm.check()


class NB(nnx.Module):
    def __init__(self, d, rngs):
        self.l1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.l2 = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.l2(checkpoint_name(nnx.gelu(self.l1(x)), "hidden"))


def test_nnx_remat_bit_equal_to_nnx_remat():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32))
    blocks = [NB(16, nnx.Rngs(i)) for i in range(L)]

    def loss(remat, policy):
        def f(blocks, x):
            for b in blocks:
                x = remat(lambda m, x: m(x), policy=policy)(b, x)
            return jnp.sum(x * x)
        return f

    want = nnx.value_and_grad(loss(nnx.remat, CP.save_only_these_names("hidden")))(blocks, x)
    o0, r0, t0 = counts()
    got = nnx.value_and_grad(loss(jf.nnx_remat, P.offload_only_these_names("hidden")))(blocks, x)
    o1, r1, t1 = counts()
    assert_bit_equal(got, want)
    assert (o1 - o0, r1 - r0, t1 - t0) == (L, L, 0)
    jaxvmm.check()
