"""``after``: order an array after others inside jit, whatever their values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _sharded
from ._ticket import Ticket


_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _dep_scalar(deps: list):
    """A uint32 scalar that exists only once every array in ``deps`` does (the bits of each one's first
    element, or-ed). Its value is meaningless: :func:`_tie_leaf` uses it so that the result does not
    depend on it."""
    s = None
    for d in deps:
        if jnp.issubdtype(d.dtype, jnp.complexfloating):
            d = jnp.real(d)
        if _explicitly_sharded(d):  # jax refuses to slice one element out of a dimension typed as sharded
            e = jnp.max(d)
        else:
            e = d[(0,) * d.ndim] if d.ndim else d  # indexing, not ravel: ravel of a sharded array gathers it
        if e.dtype == jnp.bool_ or e.dtype.itemsize not in _UINT or jax.dtypes.issubdtype(e.dtype, jax.dtypes.extended):
            u = e.astype(jnp.uint32) if not jax.dtypes.issubdtype(e.dtype, jax.dtypes.extended) else None
        else:
            u = jax.lax.bitcast_convert_type(e, _UINT[e.dtype.itemsize]).astype(jnp.uint32)
        if u is not None:
            s = u if s is None else s | u
    return s


def _explicitly_sharded(d) -> bool:
    """``d``'s type says it is sharded (a mesh with Explicit axes): jax checks slicing against it."""
    try:
        spec = getattr(getattr(_sharded._typeof(d), "sharding", None), "spec", None)
    except TypeError:
        return False
    return any(e is not None for e in (spec or ()))


def _tie_leaf(x, s):
    """``x`` unchanged, computed from the scalar ``s``: ``min(b, b | s)`` is ``b`` for every unsigned ``b``
    and ``s``, so the result is bit-exact whatever the values (inf, nan, -0.0 included), yet XLA must
    compute ``s`` first. Arithmetic on purpose: XLA:CPU removes optimization barriers before it schedules.
    Returns None for dtypes it cannot handle."""
    dt = x.dtype
    if dt == jnp.bool_:
        return x & (x | s.astype(jnp.bool_))
    if jax.dtypes.issubdtype(dt, jax.dtypes.extended) or jnp.issubdtype(dt, jnp.complexfloating):
        return None
    u = _UINT.get(dt.itemsize)
    if u is None:
        return None
    b = x if dt == u else jax.lax.bitcast_convert_type(x, u)
    b = jnp.minimum(b, b | s.astype(u))
    return b if dt == u else jax.lax.bitcast_convert_type(b, dt)


def _tie_cpu(x_leaves, deps):
    s = _dep_scalar(deps)
    if s is None:
        return list(jax.lax.optimization_barrier((x_leaves, deps))[0])
    out = []
    for x in x_leaves:
        t = _tie_leaf(x, s)
        out.append(jax.lax.optimization_barrier((x, deps))[0] if t is None else t)
    return out


def tie(x_leaves: list, deps: list, *, small: bool = False) -> list:
    """``x_leaves`` with a value-independent dependency on ``deps``. On GPUs an optimization_barrier
    (free; XLA:GPU removes barriers only after scheduling). On cpu, where XLA removes barriers before it
    schedules, elementwise arithmetic that leaves the bits unchanged (:func:`_tie_leaf`). ``small``: the
    leaves are tiny (ticket tokens), use the arithmetic everywhere."""
    x_leaves = [jnp.asarray(x) for x in x_leaves]
    deps = [d for d in deps if isinstance(d, (jax.Array, np.ndarray)) and d.dtype != jax.dtypes.float0 and d.size]
    if not x_leaves or not deps:
        return x_leaves
    if small:
        return _tie_cpu(x_leaves, deps)
    return list(jax.lax.platform_dependent(
        x_leaves, deps, cpu=_tie_cpu,
        default=lambda xs, ds: list(jax.lax.optimization_barrier((xs, ds))[0])))


def after(dep, x):
    """``x``, ordered after ``dep``: inside jit, nothing that uses the returned ``x`` can run before every
    array in ``dep`` (a pytree: arrays, :class:`Ticket` s, ...) exists. Values are bit-exact whatever
    they are (inf and nan included): the dependency does not look at them. Gradients flow through
    ``x``; ``x`` may be an array, a Ticket or a pytree of them.

    Use it to make XLA run an offload where it is written::

        t = jaxvmm.offload(y)
        x = jaxvmm.after(t, x)         # what uses x below runs after the offload
        z = heavy(x)
        out = jaxvmm.reload(t, after=z) * z

    Cost: nothing on GPUs (an ``optimization_barrier``); on cpu an elementwise pass over ``x`` (XLA:CPU
    drops barriers before scheduling), so tie something small when you can."""
    x_leaves, tree = jax.tree.flatten(x)
    for v in x_leaves:
        if not isinstance(v, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(f"jaxvmm.after: x must be an array, a Ticket or a pytree of them; got a leaf of type "
                            f"{type(v).__name__}")
    for d in jax.tree.leaves(dep):
        if not isinstance(d, (jax.Array, np.ndarray, np.generic, int, float, complex)):  # Python numbers: no order
            raise TypeError(f"jaxvmm.after: dep must be an array, a Ticket or a pytree of them; got a leaf of type "
                            f"{type(d).__name__}")
    small = isinstance(x, Ticket)
    return jax.tree.unflatten(tree, tie(x_leaves, jax.tree.leaves(dep), small=small))
