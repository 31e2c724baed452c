"""``jaxvmm.checkpoint``: ``jax.checkpoint`` whose saved residuals leave the device through jaxvmm.

How: the forward rule of a ``jax.custom_vjp`` runs ``jax.vjp`` of ``jax.checkpoint(fn, policy=save)``.
The residuals that policy saves are exactly the leaves of the returned VJP function; those that are
not inputs of ``fn`` and are large enough are offloaded (their ticket tokens become the custom_vjp
residuals), the rest stay. The backward rule reloads them, rebuilds the VJP function and applies it,
so gradients are those of ``jax.checkpoint`` with the same policy, computed from bit-identical
residuals.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from .policies import OffloadPolicy, resolve


def _offloadable(leaf, policy: OffloadPolicy, input_ids: set[int]) -> bool:
    if not isinstance(leaf, jax.Array) or id(leaf) in input_ids:
        return False
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or dtype == jax.dtypes.float0:
        return False
    nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return nbytes > 0 and nbytes >= policy.min_bytes


def _after(g):
    """A uint32 zero that XLA cannot compute before the cotangent ``g`` exists.

    A reload depends only on its token, so without this XLA may schedule it right after the offload
    (outside ``lax.scan`` it does), which keeps the residual on the device all along. ``x * 0 != 0`` is
    not foldable (it is true for inf and nan), so the dependency survives optimization; adding it to the
    token leaves the token unchanged whenever ``g`` is finite."""
    for leaf in jax.tree.leaves(g):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size:
            x = jnp.ravel(leaf)[0]
            return (jnp.real(x) * 0 != 0).astype(jnp.uint32)
    return jnp.zeros((), jnp.uint32)


def _static_argnums(static_argnums, nargs: int) -> tuple[int, ...]:
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    out = []
    for i in static_argnums:
        i = operator.index(i)
        if not -nargs <= i < nargs:
            raise ValueError(f"jaxvmm.checkpoint: static_argnums {i} out of range for {nargs} arguments")
        out.append(i % nargs)
    return tuple(sorted(set(out)))


def checkpoint(fn, *, policy=None, prevent_cse: bool = True, static_argnums=()):
    """Like ``jax.checkpoint(fn, policy=..., prevent_cse=..., static_argnums=...)``, but residuals the
    policy saves are offloaded to pinned host memory through jaxvmm and reloaded (prefetched in reverse
    order) in the backward pass. Use inside ``lax.scan`` over layers like ``jax.checkpoint``.

    ``policy``: ``None`` (save nothing: plain rematerialization), a ``jaxvmm.policies`` policy, or any
    ``jax.checkpoint_policies`` policy (what it saves is offloaded when at least 64 KiB)."""
    if not callable(fn):
        raise TypeError(f"jaxvmm.checkpoint: fn must be callable, not {type(fn).__name__}")
    spec = resolve(policy)
    if not isinstance(prevent_cse, bool):
        raise TypeError("jaxvmm.checkpoint: prevent_cse must be a bool")
    if isinstance(static_argnums, int):
        static_argnums = (static_argnums,)
    if isinstance(static_argnums, (str, bytes)) or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in static_argnums):
        raise ops.errors.InvalidArgumentTypeError(
            f"jaxvmm.checkpoint: static_argnums must be an int or ints, got {static_argnums!r}", code="invalid_argument")
    static_argnums = tuple(static_argnums)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs:
            raise TypeError(f"jaxvmm.checkpoint: keyword arguments are not supported (got {sorted(kwargs)}); pass "
                            "them positionally, and mark non-array ones with static_argnums")
        statics = _static_argnums(static_argnums, len(args))
        static_vals = {i: args[i] for i in statics}
        dyn_idx = [i for i in range(len(args)) if i not in static_vals]

        def f_dyn(*dyn):
            full = list(args)
            for i, v in zip(dyn_idx, dyn):
                full[i] = v
            return fn(*full)

        dyn_args = [args[i] for i in dyn_idx]
        # Values fn closes over that are being differentiated (tracers) become explicit inputs, so the
        # custom_vjp below sees them and gradients reach them; as inputs they are never offloaded.
        converted, consts = jax.closure_convert(f_dyn, *dyn_args)
        n_dyn = len(dyn_args)
        ckpt = jax.checkpoint(converted, policy=spec.save, prevent_cse=prevent_cse)
        layout = {}  # filled while the forward rule is traced; read by the backward rule

        @jax.custom_vjp
        def run(*dyn):
            return ckpt(*dyn)

        def fwd(*dyn):
            out, vjp_fn = jax.vjp(ckpt, *dyn)
            leaves, treedef = jax.tree.flatten(vjp_fn)
            input_ids = {id(x) for x in jax.tree.leaves(dyn)}
            tie = next((x for x in jax.tree.leaves(dyn[:n_dyn]) if isinstance(x, jax.Array)), None)
            res, kinds = [], []
            for leaf in leaves:
                if _offloadable(leaf, spec, input_ids):
                    if tie is not None:
                        # Tie the offload to this call's own inputs: a residual that depends only on
                        # loop constants would otherwise be offloaded once outside lax.scan while its
                        # reload (which waits for the cotangent) runs every iteration.
                        leaf = jax.lax.optimization_barrier((leaf, tie))[0]
                    t = ops.offload(leaf)
                    res.append(t.token)
                    kinds.append((t.shape, t.dtype))
                else:
                    res.append(leaf)
                    kinds.append(None)
            layout["treedef"], layout["kinds"] = treedef, kinds
            return out, tuple(res)

        def bwd(res, g):
            after = _after(g)
            leaves = [r if k is None else ops.reload(ops.Ticket(r + after, *k)) for r, k in zip(res, layout["kinds"])]
            vjp_fn = jax.tree.unflatten(layout["treedef"], leaves)
            return vjp_fn(g)

        run.defvjp(fwd, bwd)
        return run(*dyn_args, *consts)

    return wrapped


remat = checkpoint
