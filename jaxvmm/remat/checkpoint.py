"""``jaxvmm.checkpoint``: ``jax.checkpoint`` whose offloadable residuals leave the device through jaxvmm.

``jaxvmm.checkpoint(fun, policy=P, ...)`` returns ``jax.checkpoint(fun, policy=VmmPolicy(P), ...)``:
the same ``remat`` primitive, so it composes with everything ``jax.checkpoint`` composes with. A
policy answers, per primitive application, save (``True``/``Saveable``), offload
(``Offloadable(src, dst)``) or recompute (``False``/``Recompute``), exactly as for ``jax.checkpoint``;
what it marks offloadable leaves through jaxvmm instead of XLA's host memory space. How the residuals
are told apart and moved: ``_rules.py``.
"""

from __future__ import annotations

import functools
import operator

import jax
import numpy as np

from .. import _jax_compat as _jc
from .. import errors
from . import _rules
from .policies import resolve

def _static_argnums(static_argnums, nargs: int) -> tuple[int, ...]:
    out = []
    for i in static_argnums:
        if not -nargs <= i < nargs:
            raise errors.InvalidArgumentError(f"jaxvmm.checkpoint: static_argnums {i} out of range for {nargs} arguments; the "
                             f"function was called with {nargs} positional arguments, so static_argnums must be in "
                             f"[{-nargs}, {nargs})", code="invalid_argument")
        out.append(i % nargs)
    return tuple(sorted(set(out)))


def _check_static_argnums(static_argnums) -> tuple[int, ...]:
    bad = errors.InvalidArgumentTypeError(
        f"jaxvmm.checkpoint: static_argnums must be an int or a tuple of ints (positions of the arguments that "
        f"are Python values, not arrays), got {static_argnums!r}; e.g. static_argnums=(2,)", code="invalid_argument")
    if isinstance(static_argnums, (str, bytes, float, bool, np.bool_)) or static_argnums is None:
        raise bad
    if isinstance(static_argnums, (int, np.integer)):
        return (int(static_argnums),)
    try:
        items = tuple(static_argnums)
    except TypeError:
        raise bad from None
    for i in items:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
            raise bad
    return tuple(operator.index(i) for i in items)


def _check_static_argnames(static_argnames) -> tuple[str, ...]:
    if isinstance(static_argnames, str):
        static_argnames = (static_argnames,)
    try:
        names = tuple(static_argnames)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise errors.InvalidArgumentTypeError(f"jaxvmm.checkpoint: static_argnames must be a str or a tuple of str (names of keyword "
                        f"arguments that are Python values), got {static_argnames!r}", code="invalid_argument")
    return names



def _check_prevent_cse(prevent_cse):
    if isinstance(prevent_cse, (bool, np.bool_)):
        return bool(prevent_cse)
    leaves = jax.tree.leaves(prevent_cse) if isinstance(prevent_cse, (tuple, list, dict)) else None
    if leaves is not None and all(isinstance(b, (bool, np.bool_)) for b in leaves):
        return jax.tree.map(bool, tuple(prevent_cse) if isinstance(prevent_cse, list) else prevent_cse)
    raise errors.InvalidArgumentTypeError(
        f"jaxvmm.checkpoint: prevent_cse must be a bool or a tuple of bools (one per positional argument, "
        f"or a pytree prefix of them), got {prevent_cse!r}; e.g. prevent_cse=False inside lax.scan",
        code="invalid_argument")


_JAX_ONLY = {
    "concrete": "it was removed from jax.checkpoint; mark Python-valued arguments with static_argnums instead",
    "fn": "the function is the first positional argument (named fun, as in jax.checkpoint)",
}


def checkpoint(fun=None, *, prevent_cse=True, policy=None, static_argnums=(), static_argnames=(), **unsupported):
    """``jax.checkpoint(fun, prevent_cse=..., policy=..., static_argnums=..., static_argnames=...)`` whose
    offloadable residuals leave the device through jaxvmm (pinned host memory) in the forward pass and
    come back in the backward pass. Use it where you use ``jax.checkpoint``, inside ``lax.scan`` over
    layers too; it composes with what ``jax.checkpoint`` composes with (``jax.grad``, ``jax.vjp``,
    ``jax.linearize``, ``jax.jvp``, ``jax.jacfwd``/``jacrev``/``hessian``, ``vmap``, ``jit``, nested
    checkpoints, keyword arguments, effects and refs ``jax.checkpoint`` allows).

    ``policy`` means what it means to ``jax.checkpoint``: ``None`` saves nothing (plain
    rematerialization); what a policy marks saveable (``True``/``Saveable``) is saved on the device; what
    it marks ``Offloadable(src, dst)`` is offloaded through jaxvmm (whatever memory kinds it names); the
    rest is recomputed. ``jaxvmm.policies`` has JAX's policies under JAX's names plus
    ``offload_only_these_names`` and ``offload_everything_saveable``.

    Gradients are those of ``jax.checkpoint`` with the same policy, bit for bit. Residuals that an outer
    differentiation differentiates again (grad of grad, ``jax.hessian``, Hessian-vector products) stay
    on the device: a ticket cannot carry a derivative. When the first derivative was staged first
    (``jax.hessian(jax.jit(f))``, ``jax.grad(jax.jit(jax.grad(f)))``), the residuals' tangents or
    cotangents go through tickets with them. A VJP or linearized function may be called (or jitted and
    called) any number of times, also when a jitted program returned it and another jitted program takes
    it as an argument; its offloaded residuals are freed when it dies. JAX's own ``saved_residuals``
    lists an offloaded residual as its array, marked ``offloaded through jaxvmm``. Under ``jax_remat3=True``
    a call with a policy is refused (JAX's remat3 path is not hooked: nothing would be offloaded)."""
    if unsupported:
        name = min(unsupported)
        why = _JAX_ONLY.get(name, "jaxvmm.checkpoint takes fun, prevent_cse, policy, static_argnums and "
                                  "static_argnames, like jax.checkpoint")
        raise errors.InvalidArgumentTypeError(
            f"jaxvmm.checkpoint: unsupported keyword argument {name}={unsupported[name]!r}: {why}",
            code="invalid_argument")
    if not callable(fun):
        hint = (" (it looks like a decorator was given arguments but no function: use "
                "functools.partial(jaxvmm.checkpoint, policy=...) as the decorator)") if fun is None else ""
        raise errors.InvalidArgumentTypeError(f"jaxvmm.checkpoint: fun must be callable, not {type(fun).__name__}{hint}",
                                              code="invalid_argument")
    jax_policy = _rules.VmmPolicy(resolve(policy))
    if policy is not None and _jc.remat3_on():
        raise errors.NotSupportedError(
            "jaxvmm.checkpoint: jax_remat3=True is set, so jax.checkpoint takes JAX's remat3 path, which jaxvmm "
            "does not hook: nothing would be offloaded (the values would be jax.checkpoint's, the memory not "
            "saved). Leave jax_remat3 off (the default; jax.config.update('jax_remat3', False) before this "
            "jaxvmm.checkpoint call), or use jax.checkpoint for this function", code="not_supported")
    prevent_cse = _check_prevent_cse(prevent_cse)
    static_argnums = _check_static_argnums(static_argnums)
    static_argnames = _check_static_argnames(static_argnames)
    make = functools.partial(jax.checkpoint, prevent_cse=prevent_cse, policy=jax_policy,
                             static_argnums=static_argnums)
    plain = make(fun)
    by_statics = {}  # static keyword values -> jax.checkpoint of fun with them bound (JAX's remat ignores
    # static_argnames, so they are closed over here; one function per value keeps JAX's trace cache warm)

    def ckpt_for(static_kw):
        if not static_kw:
            return plain
        key = tuple(sorted(static_kw.items()))
        try:
            hash(key)
        except TypeError:  # unhashable static values: traced each call, as jax.jit would refuse them
            key = None
        got = by_statics.get(key) if key is not None else None
        if got is None:
            bound = functools.wraps(fun)(lambda *a, **k: fun(*a, **k, **static_kw))
            got = make(bound)
            if key is not None:
                if len(by_statics) >= 256:
                    by_statics.clear()
                by_statics[key] = got
        return got

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if static_argnums:
            _static_argnums(static_argnums, len(args))
        if isinstance(prevent_cse, tuple) and not kwargs:
            n = len(args) - len(set(i % len(args) for i in static_argnums)) if args else 0
            if len(prevent_cse) != n:
                raise errors.InvalidArgumentError(
                    f"jaxvmm.checkpoint: prevent_cse has {len(prevent_cse)} entries but the call has {n} "
                    "non-static positional arguments; give one bool (or pytree prefix) per argument",
                    code="invalid_argument")
        static_kw = {k: kwargs.pop(k) for k in static_argnames if k in kwargs}
        try:
            return ckpt_for(static_kw)(*args, **kwargs)
        except TypeError as e:
            if "is not a valid JAX type" in str(e) and not isinstance(e, errors.VmmError):
                raise errors.InvalidArgumentTypeError(
                    f"jaxvmm.checkpoint: an argument is not an array ({str(e).splitlines()[0]}); mark "
                    "Python-valued arguments with static_argnums (positional) or static_argnames (keyword)",
                    code="invalid_argument") from e
            raise

    wrapped.policy = jax_policy  # what JAX's remat sees (jaxvmm.saved_residuals reads it)
    return wrapped


remat = checkpoint


# ---- what is saved ----
def _is_offload(eqn) -> bool:
    """A jaxvmm offload: the ffi call itself, or a call whose body is one (the custom_jvp around it)."""
    if eqn.params.get("target_name") == "jaxvmm_offload":
        return True
    for p in eqn.params.values():
        body = getattr(p, "jaxpr", p)
        eqns = getattr(body, "eqns", None)
        if eqns is not None and any(_is_offload(e) for e in eqns):
            return True
    return False


def _describe(v, producers, invars) -> tuple:
    """(aval, description) of residual ``v``, in the words of ``jax.ad_checkpoint.saved_residuals``;
    a ticket token is described by the array it stands for."""
    from jax.extend.core import Literal

    if isinstance(v, Literal):
        return v.aval, "from a literal"
    if v in invars:
        return v.aval, f"from the argument at flattened index {invars.index(v)}"
    eqn = producers.get(v)
    if eqn is None:
        return v.aval, "from a constant"
    name = eqn.primitive.name
    if name == "reduce_precision":  # as JAX does: look through the rounding JAX inserts on residuals
        aval, what = _describe(eqn.invars[0], producers, invars)
        return v.aval, what
    src = _jc.summarize_source_info(eqn.source_info)
    if name == "jaxvmm_checkpoint_shadow":  # travels with a traced offload's token (see remat/_rules.py)
        return v.aval, ("jaxvmm shadow of the residual offloaded before it (under forward-mode differentiation "
                        "it carries the ticket of that residual's tangent)")
    if _is_offload(eqn):
        x = eqn.invars[0]
        inner = producers.get(x)
        if inner is not None and inner.primitive.name == "stop_gradient":  # the traced offload's input
            x = inner.invars[0]
            inner = producers.get(x)
        if inner is not None and inner.primitive.name == "optimization_barrier":
            x = inner.invars[list(inner.outvars).index(x)]
        aval, what = _describe(x, producers, invars)
        return aval, f"offloaded through jaxvmm: {what}"
    if name == "name":
        return v.aval, f"named '{eqn.params['name']}' from {src}"
    if name in ("jit", "pjit"):
        return v.aval, f"output of jitted function '{eqn.params.get('name')}' from {src}"
    return v.aval, f"output of {name} from {src}"


def saved_residuals(f, *args, **kwargs) -> list:
    """``jax.ad_checkpoint.saved_residuals`` that names what jaxvmm offloads: one ``(aval, description)``
    per residual ``jax.vjp(f, *args, **kwargs)`` keeps, in the order the VJP function holds them. A
    residual offloaded through jaxvmm is listed with the aval of the array it stands for (its ticket
    token is what stays) and a description starting ``offloaded through jaxvmm:`` followed by JAX's
    words for the array (``named 'hidden' from ...``)."""
    flat, tree = jax.tree.flatten((args, kwargs))

    def f_(*flat):
        a, k = jax.tree.unflatten(tree, flat)
        return f(*a, **k)

    closed, shape = jax.make_jaxpr(lambda *a: jax.vjp(f_, *a), return_shape=True)(*flat)
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shape[1]))
    producers = {o: e for e in jaxpr.eqns for o in e.outvars}
    invars = list(jaxpr.invars)
    return [_describe(v, producers, invars) for v in jaxpr.outvars[len(jaxpr.outvars) - n:]]


# ---- JAX's own saved_residuals, told about jaxvmm ----
# jax.ad_checkpoint.saved_residuals / print_saved_residuals (and JAX's residual log) describe residuals
# through JAX's ad_checkpoint._saved_residuals. Left alone they would list an offloaded residual as
# its u32[2] ticket token ("output of custom_jvp_call") followed by its f32[2] shadow. The hook below
# lists it as the array it stands for, in JAX's words ("named 'hidden' from model.py:5 (f)"), with
# ", offloaded through jaxvmm" appended, and leaves the shadows out: what jax.checkpoint would list.
_OFFLOADED = ", offloaded through jaxvmm"


def _scan_num_carry(params) -> int:
    """How many of a scan equation's outputs are its carry (jax <= 0.10: num_carry; jax 0.11: the first
    part of its flat output tree, ft_out)."""
    if "num_carry" in params:
        return params["num_carry"]
    return len(params["ft_out"].unpack()[0])


def _offloaded_value(v, producers):
    """For residual ``v`` of a jaxpr: ``("shadow",)``, ``("token", x, aval)`` with ``x`` the variable
    offloaded (None when it lives inside a nested jit) and ``aval`` its type, or None."""
    from jax.extend.core import Literal

    eqn = None if isinstance(v, Literal) else producers.get(v)
    if eqn is None:
        return None
    if eqn.primitive is _rules.shadow_p:
        return ("shadow",)
    name = eqn.primitive.name
    if name in ("jit", "pjit", "scan"):  # a residual that a nested jit returns, or a scan stacks
        inner, k = eqn.params["jaxpr"].jaxpr, list(eqn.outvars).index(v)
        stacked = name == "scan"
        if stacked and k < _scan_num_carry(eqn.params):
            return None
        got = _offloaded_value(inner.outvars[k], {o: e for e in inner.eqns for o in e.outvars})
        if got is None or got[0] == "shadow":
            return got
        aval = got[2].update(shape=(eqn.params["length"], *got[2].shape)) if stacked else got[2]
        return ("token", None, aval)
    # the offload itself (its ffi call, or the custom_jvp / sharded call around it) makes a uint32[..., 2] token
    if (name in ("scan", "while", "cond", "remat2", "checkpoint") or v.aval.dtype != np.uint32
            or v.aval.shape[-1:] != (2,) or not _is_offload(eqn)):
        return None
    x = eqn.invars[0]
    while not isinstance(x, Literal):
        inner = producers.get(x)
        if inner is None or inner.primitive.name not in ("stop_gradient", "optimization_barrier"):
            break
        x = inner.invars[list(inner.outvars).index(x)]
    return ("token", None if isinstance(x, Literal) else x, x.aval)


def _jax_order(jaxpr, outvars) -> list:
    """The variables JAX's ``ad_checkpoint._saved_residuals`` describes for ``outvars``, in its order."""
    from jax.extend.core import Literal

    subst = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive is _jc.reduce_precision_p}
    res = {subst.get(v, v) for v in outvars if not isinstance(v, Literal)}
    return ([v for v in outvars if isinstance(v, Literal)] + [v for v in jaxpr.constvars if v in res]
            + [v for v in jaxpr.invars if v in res] + [v for e in jaxpr.eqns for v in e.outvars if v in res]), subst


def _saved_residuals_hook(jax_fn):
    def hook(jaxpr, arg_names):
        try:
            producers = {o: e for e in jaxpr.eqns for o in e.outvars}
            found = [_offloaded_value(v, producers) for v in jaxpr.outvars]
            if not any(found):
                return jax_fn(jaxpr, arg_names)
            outvars, moved, retyped = [], set(), {}
            for v, got in zip(jaxpr.outvars, found):
                if got is None:
                    outvars.append(v)
                elif got[0] == "token":
                    x = got[1]
                    if x is None or x in outvars or x in jaxpr.outvars:  # keep the token, described as x
                        outvars.append(v)
                        moved.add(v)
                        retyped[v] = got[2]
                    else:
                        outvars.append(x)
                        moved.add(x)
            order, subst = _jax_order(jaxpr, outvars)
            results = jax_fn(jaxpr.replace(outvars=outvars), arg_names)
            if len(order) != len(results):
                raise ValueError("unexpected order")
            moved = {subst.get(v, v) for v in moved}
            return [(retyped.get(v, aval), what + _OFFLOADED if v in moved else what)
                    for v, (aval, what) in zip(order, results)]
        except Exception:  # a JAX whose jaxprs or function differ: JAX's words for the jaxpr as it is
            return jax_fn(jaxpr, arg_names)

    hook.__wrapped_by_jaxvmm__ = jax_fn
    return hook


def _install_saved_residuals_hook() -> None:
    fn = _jc.saved_residuals_function()
    if fn is not None and getattr(fn, "__wrapped_by_jaxvmm__", None) is None:
        _jc.set_saved_residuals_function(_saved_residuals_hook(fn))


_install_saved_residuals_hook()


def print_saved_residuals(f, *args, **kwargs) -> None:
    """Prints :func:`saved_residuals`, one residual a line, like ``jax.ad_checkpoint.print_saved_residuals``."""
    for aval, what in saved_residuals(f, *args, **kwargs):
        print(f"{aval.str_short(short_dtypes=True)} {what}")
