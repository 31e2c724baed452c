"""What jax's ad.linearize hands jaxvmm's hook (a VJP function of a compiled forward): the linear jaxpr's
constants, which of them are ticket tokens its reloads read, and the structured residuals. For a jax
version bump."""
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax._src import core as C

import jaxvmm
from jaxvmm.remat import _rules as R

orig = R._jax_linearize


def traced(*a, **k):
    out = orig(*a, **k)
    try:
        jaxpr, consts = out[2], out[3]
        print("linearize: jaxpr", type(jaxpr).__name__, "consts", type(consts).__name__, len(consts), "outputs", len(out))
        for v, c in zip(jaxpr.constvars, consts):
            print("  const", v, type(c).__name__, getattr(c, "dtype", None), getattr(c, "shape", None))
        print("  tokens found:", len(R._residual_tokens(jaxpr, consts)) if isinstance(jaxpr, C.Jaxpr) else "not a Jaxpr")
        print(jaxpr)
        if len(out) > 4 and isinstance(out[4], list):
            print("  structured leaves:", [(type(l).__name__, getattr(l, "dtype", None), getattr(l, "shape", None))
                                          for l in jax.tree.leaves(out[4])])
    except Exception as e:  # noqa: BLE001
        print("probe error", repr(e))
    return out


R._jax_linearize = traced


def fn(x):
    h = checkpoint_name(jnp.sin(x) * 2.0, "h")
    return jnp.cos(h) * x


VMM = functools.partial(jaxvmm.checkpoint, policy=jaxvmm.policies.offload_only_these_names("h"))
x = jnp.linspace(-1, 1, 64, dtype=jnp.float32)
print("--- eager vjp of a jitted checkpoint")
_, f = jax.vjp(jax.jit(VMM(fn)), x)
print(jax.jit(f)(jnp.ones_like(x))[0][:3])
print(jax.jit(f)(jnp.ones_like(x))[0][:3])
print("--- linearize of a jitted checkpoint")
_, g = jax.linearize(jax.jit(VMM(fn)), x)
print(jax.jit(g)(jnp.ones_like(x))[:3])
print(jax.jit(g)(jnp.ones_like(x))[:3])
