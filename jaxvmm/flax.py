"""Flax front ends for ``jaxvmm.checkpoint`` (import ``jaxvmm.flax``; needs flax).

* :func:`remat`: the linen lifted transform, used like ``nn.remat`` (alone, as a method decorator, or
  under ``nn.scan``). It is ``flax.core.lift.checkpoint`` with ``jax.checkpoint`` replaced by
  ``jaxvmm.checkpoint``.
* :func:`nnx_remat`: the NNX helper, used like ``nnx.remat`` on a function whose arguments may be
  ``nnx.Module`` s (their state is split off, passed through ``jaxvmm.checkpoint`` and written back).

``policy`` means what it means to ``jaxvmm.checkpoint`` (JAX's meaning: saveable stays on the device,
``Offloadable`` goes through jaxvmm). Name what to offload with ``checkpoint_name`` inside the module.
"""

from __future__ import annotations

import functools

try:
    import flax.linen as nn
    from flax import nnx
    from flax.core import lift
except ImportError as e:  # pragma: no cover - exercised only without flax
    raise ImportError("jaxvmm.flax: flax is not installed (pip install flax)") from e

from .remat.checkpoint import checkpoint


def _lifted_checkpoint(fn, variables=True, rngs=True, policy=None, prevent_cse=True, static_argnums=()):
    static_argnums = tuple(i + 2 for i in ((static_argnums,) if isinstance(static_argnums, int) else static_argnums))

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        def rematted(variable_groups, rng_groups, *args):
            scope = scope_fn(variable_groups, rng_groups)
            return fn(scope, *args, **kwargs), repack_fn(scope)

        return checkpoint(rematted, policy=policy, prevent_cse=prevent_cse, static_argnums=static_argnums)(
            variable_groups, rng_groups, *args)

    return lift.pack(inner, (variables,), (variables,), (rngs,), name="jaxvmm_remat", enable_kwargs=True)


def remat(target, *, policy=None, variables=True, rngs=True, prevent_cse=True, static_argnums=(), methods=None):
    """``nn.remat`` whose offloadable residuals (what ``policy`` marks ``Offloadable``) leave the device
    through jaxvmm. ``static_argnums`` count the module method's arguments after ``self``, as in
    ``nn.remat``. Keyword arguments are closed over (Python values act as static)."""
    if static_argnums:
        static_argnums = tuple(i - 1 for i in ((static_argnums,) if isinstance(static_argnums, int) else static_argnums))
    return nn.transforms.lift_transform(_lifted_checkpoint, target, variables=variables, rngs=rngs, policy=policy,
                                        prevent_cse=prevent_cse, static_argnums=static_argnums, methods=methods)


def nnx_remat(f=None, *, policy=None, prevent_cse=True):
    """``nnx.remat`` through jaxvmm: ``f``'s ``nnx.Module`` arguments are split into (graph, state), the
    states go through ``jaxvmm.checkpoint`` as arrays, and state updates made by ``f`` are written back."""
    if f is None:
        return functools.partial(nnx_remat, policy=policy, prevent_cse=prevent_cse)

    @functools.wraps(f)
    def wrapped(*args):
        is_mod = [isinstance(a, nnx.Module) for a in args]
        graphs, states, plain = {}, {}, {}
        for i, a in enumerate(args):
            if is_mod[i]:
                graphs[i], states[i] = nnx.split(a)
            else:
                plain[i] = a

        def pure(states, plain):
            mods = {i: nnx.merge(graphs[i], states[i]) for i in graphs}
            full = [mods[i] if is_mod[i] else plain[i] for i in range(len(args))]
            out = f(*full)
            return out, {i: nnx.state(m) for i, m in mods.items()}

        out, new_states = checkpoint(pure, policy=policy, prevent_cse=prevent_cse)(states, plain)
        for i, s in new_states.items():
            nnx.update(args[i], s)
        return out

    return wrapped


__all__ = ["nnx_remat", "remat"]
