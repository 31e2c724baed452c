"""``jaxvmm.checkpoint``: ``jax.checkpoint`` whose offloadable residuals leave the device through jaxvmm.

How. A policy answers, per primitive application, save (``True``/``Saveable``), offload
(``Offloadable(src, dst)``) or recompute (``False``/``Recompute``), exactly as for ``jax.checkpoint``.
The forward rule of a ``jax.custom_vjp`` traces ``jax.vjp(jax.checkpoint(fn, policy=P))`` to a jaxpr,
where ``P`` is the user's policy with every ``Offloadable`` answer normalized to
``Offloadable("device", "pinned_host")``. JAX's own partial evaluation then does the bookkeeping: the
residuals it saves are the outputs of that jaxpr after the primal outputs (the leaves of the VJP
function), and each residual the policy marked offloadable comes out of a ``device_put`` to the host
memory space, so its type says ``memory_space=Host``. That type is the tag: no second trace, no
matching of residuals across traces, no guessing from shapes. The jaxpr is then rewritten so that
those ``device_put`` calls disappear (the value stays where it is; every host-typed variable, nested
jaxprs included, becomes a device-typed one) and evaluated. Tagged residuals are offloaded through
jaxvmm (their ticket tokens become the custom_vjp residuals); saved ones stay on the device as they
are. The backward rule reloads the tickets (ordered after the cotangent exists), rebuilds the VJP
function, rewrites its jaxpr the same way (the matching ``device_put`` back to the device goes too)
and applies it. Gradients are therefore those of ``jax.checkpoint`` with the same policy, computed from
bit-identical residuals; only where offloaded values live differs (jaxvmm's pinned pool instead of
XLA's host memory).
"""

from __future__ import annotations

import functools
import operator

import jax
import numpy as np
from jax._src import core as _core
from jax._src.dispatch import device_put_p as _device_put_p

from .. import errors, ops
from .policies import Offloadable, OffloadPolicy, Recompute, Saveable, resolve

_HOST = _core.MemorySpace.Host
_DEVICE = _core.MemorySpace.Device

_HIGHER_ORDER = (
    "jaxvmm.checkpoint: differentiating a gradient (jax.grad of jax.grad, jax.hessian, jax.jacfwd of "
    "jax.grad, jax.jvp of jax.grad) through jaxvmm.checkpoint is not supported: an offloaded residual "
    "crosses from the forward to the backward pass as an integer ticket, so its derivative with respect to "
    "the inputs cannot follow it. Use jax.checkpoint (same policy: jaxvmm policies are jax policies) for "
    "code you differentiate twice, or policy=None (recompute everything) there.")


_FORWARD_MODE = (
    "jaxvmm.checkpoint: forward-mode differentiation (jax.jvp, jax.linearize, jax.jacfwd) of a "
    "jaxvmm.checkpoint function is not supported: it is a jax.custom_vjp (reverse mode only). Use "
    "jax.grad/jax.vjp/jax.jacrev, or jax.checkpoint with the same policy for code differentiated forward.")


def _offloadable(leaf, policy: OffloadPolicy) -> bool:
    if not isinstance(leaf, jax.Array):
        return False
    dtype = leaf.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or dtype == jax.dtypes.float0:
        return False
    nbytes = int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return nbytes > 0 and nbytes >= policy.min_bytes


@functools.partial(jax.custom_jvp, nondiff_argnums=())
def _offload_token(x):
    return ops.offload(x).token


@_offload_token.defjvp
def _offload_token_jvp(primals, tangents):
    raise TypeError(_HIGHER_ORDER)


# ---- the policy JAX sees ----
def _jax_policy(spec: OffloadPolicy):
    """The user's policy as JAX sees it: answers checked, ``Offloadable`` normalized to device -> host
    (the memory kinds the user named do not matter: offloaded values go through jaxvmm)."""
    user = spec.policy
    tag = Offloadable(src="device", dst="pinned_host")

    def policy(prim, *avals, **params):
        case = user(prim, *avals, **params)
        if isinstance(case, (bool, np.bool_)):
            return bool(case)
        if case is Saveable or case is Recompute:
            return case
        if isinstance(case, Offloadable):
            return tag
        if case is Offloadable or callable(case):
            hint = (" (Offloadable must be instantiated: Offloadable(src='device', dst='pinned_host'))"
                    if case is Offloadable else
                    " (a function: was a policy factory passed without being called, or does the policy "
                    "return a policy?)")
        else:
            hint = ""
        raise TypeError(f"jaxvmm.checkpoint: the policy {spec!r} answered {case!r} for primitive {prim}{hint}; "
                        "a policy must return a bool, jaxvmm.policies.Saveable, jaxvmm.policies.Recompute or "
                        "jaxvmm.policies.Offloadable(src, dst)")

    return policy


# ---- rewriting host-tagged jaxprs ----
def _is_host(aval) -> bool:
    return getattr(aval, "memory_space", None) is _HOST


def _retype_param(p):
    if isinstance(p, _core.ClosedJaxpr):
        j = _retype(p.jaxpr)
        return p if j is p.jaxpr else _core.ClosedJaxpr(j, p.consts)
    if isinstance(p, _core.Jaxpr):
        return _retype(p)
    if isinstance(p, (tuple, list)) and any(isinstance(q, (_core.Jaxpr, _core.ClosedJaxpr)) for q in p):
        new = [_retype_param(q) for q in p]
        return p if all(a is b for a, b in zip(new, p)) else type(p)(new)
    return p


def _retype(jaxpr):
    """``jaxpr`` with every host-memory-space variable turned into a device one, ``device_put`` calls to
    the host dropped (their output is their input) and ``device_put`` calls of a host value back to the
    device dropped too. Nested jaxprs (jit, scan, cond, while, remat, custom rules) are rewritten alike.
    Returns ``jaxpr`` itself when nothing in it is host-typed."""
    env = {}
    changed = False

    def new(v):
        nonlocal changed
        if isinstance(v, _core.Literal):
            return v
        got = env.get(v)
        if got is not None:
            return got
        nv = v
        if _is_host(v.aval):
            aval = v.aval.update(memory_space=_DEVICE)
            nv = _core.DropVar(aval) if isinstance(v, _core.DropVar) else _core.Var(aval)
            changed = True
        env[v] = nv
        return nv

    constvars = [new(v) for v in jaxpr.constvars]
    invars = [new(v) for v in jaxpr.invars]
    eqns = []
    for eqn in jaxpr.eqns:
        ins = [new(v) for v in eqn.invars]
        if eqn.primitive is _device_put_p:
            devices = eqn.params["devices"]
            to_host = all(d is _HOST for d in devices)
            back = all(d is _DEVICE for d in devices) and all(_is_host(v.aval) for v in eqn.invars)
            if to_host or back:
                changed = True
                for o, i in zip(eqn.outvars, ins):
                    if not isinstance(o, _core.DropVar):
                        env[o] = i
                continue
        params = {k: _retype_param(p) for k, p in eqn.params.items()}
        if any(params[k] is not eqn.params[k] for k in params):
            changed = True
        outs = [new(v) for v in eqn.outvars]
        eqns.append(eqn.replace(invars=ins, outvars=outs, params=params))
    outvars = [new(v) for v in jaxpr.outvars]
    if not changed:
        return jaxpr
    return jaxpr.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)


def _call_retyped(f, *args):
    """``f(*args)``, traced to a jaxpr, rewritten by :func:`_retype` and evaluated at the caller's level."""
    flat, in_tree = jax.tree.flatten(args)
    keep = [i for i, x in enumerate(flat) if getattr(x, "dtype", None) == jax.dtypes.float0]
    box = {}

    def traced(*dyn):
        full = list(dyn)
        for i in keep:  # float0 (integer inputs' cotangents) cannot be jaxpr inputs: passed as they are
            full.insert(i, flat[i])
        out = f(*jax.tree.unflatten(in_tree, full))
        leaves, box["tree"] = jax.tree.flatten(out)
        box["static"] = {i: x for i, x in enumerate(leaves) if getattr(x, "dtype", None) == jax.dtypes.float0}
        return [x for i, x in enumerate(leaves) if i not in box["static"]]

    dyn = [x for i, x in enumerate(flat) if i not in keep]
    closed = jax.make_jaxpr(traced)(*dyn)
    vals = iter(_core.eval_jaxpr(_retype(closed.jaxpr), closed.consts, *dyn))
    n = len(box["static"]) + len(closed.jaxpr.outvars)
    return jax.tree.unflatten(box["tree"], [box["static"][i] if i in box["static"] else next(vals) for i in range(n)])


def _static_argnums(static_argnums, nargs: int) -> tuple[int, ...]:
    out = []
    for i in static_argnums:
        if not -nargs <= i < nargs:
            raise ValueError(f"jaxvmm.checkpoint: static_argnums {i} out of range for {nargs} arguments; the "
                             f"function was called with {nargs} positional arguments, so static_argnums must be in "
                             f"[{-nargs}, {nargs})")
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
        raise TypeError(f"jaxvmm.checkpoint: static_argnames must be a str or a tuple of str (names of keyword "
                        f"arguments that are Python values), got {static_argnames!r}")
    return names


def _check_prevent_cse(prevent_cse):
    if isinstance(prevent_cse, (bool, np.bool_)):
        return bool(prevent_cse)
    if isinstance(prevent_cse, (tuple, list)) and all(isinstance(b, (bool, np.bool_)) for b in prevent_cse):
        return tuple(bool(b) for b in prevent_cse)
    raise TypeError(f"jaxvmm.checkpoint: prevent_cse must be a bool or a tuple of bools (one per non-static "
                    f"positional argument), got {prevent_cse!r}; e.g. prevent_cse=False inside lax.scan")


_JAX_ONLY = {
    "concrete": "it is deprecated in jax.checkpoint; mark Python-valued arguments with static_argnums instead",
}


def checkpoint(fn, *, policy=None, prevent_cse=True, static_argnums=(), static_argnames=(), **unsupported):
    """``jax.checkpoint(fn, policy=..., prevent_cse=..., static_argnums=..., static_argnames=...)`` whose
    offloadable residuals leave the device through jaxvmm (pinned host memory) in the forward pass and
    come back (prefetched in reverse order) in the backward pass. Use it where you use ``jax.checkpoint``,
    inside ``lax.scan`` over layers too.

    ``policy`` means what it means to ``jax.checkpoint``: ``None`` saves nothing (plain
    rematerialization); what a policy marks saveable (``True``/``Saveable``) is saved on the device; what
    it marks ``Offloadable(src, dst)`` is offloaded through jaxvmm (whatever memory kinds it names); the
    rest is recomputed. ``jaxvmm.policies`` has JAX's policies under JAX's names plus
    ``offload_only_these_names`` and ``offload_everything_saveable``.

    Gradients are those of ``jax.checkpoint`` with the same policy, bit for bit. Not supported:
    differentiating the gradient again (grad of grad, ``jax.hessian``) and ``jax.jvp``: both raise a
    ``jaxvmm.checkpoint:`` error. See the module docstring for how residuals are told apart."""
    if unsupported:
        name = min(unsupported)
        why = _JAX_ONLY.get(name, "jaxvmm.checkpoint takes policy, prevent_cse, static_argnums and static_argnames")
        raise TypeError(f"jaxvmm.checkpoint: unsupported keyword argument {name}={unsupported[name]!r}: {why}")
    if not callable(fn):
        hint = (" (it looks like a decorator was given arguments but no function: use "
                "functools.partial(jaxvmm.checkpoint, policy=...) as the decorator)") if fn is None else ""
        raise TypeError(f"jaxvmm.checkpoint: fn must be callable, not {type(fn).__name__}{hint}")
    spec = resolve(policy)
    jax_policy = _jax_policy(spec)
    prevent_cse = _check_prevent_cse(prevent_cse)
    static_argnums = _check_static_argnums(static_argnums)
    static_argnames = _check_static_argnames(static_argnames)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        statics = _static_argnums(static_argnums, len(args))
        dyn_idx = [i for i in range(len(args)) if i not in statics]
        static_kw = {k: v for k, v in kwargs.items() if k in static_argnames}
        dyn_kw = {k: v for k, v in kwargs.items() if k not in static_argnames}
        if isinstance(prevent_cse, tuple) and len(prevent_cse) != len(dyn_idx):
            raise ValueError(f"jaxvmm.checkpoint: prevent_cse has {len(prevent_cse)} entries but the call has "
                             f"{len(dyn_idx)} non-static positional arguments; give one bool per argument")

        def f_dyn(dyn_args, dyn_kwargs):
            full = list(args)
            for i, v in zip(dyn_idx, dyn_args):
                full[i] = v
            return fn(*full, **static_kw, **dyn_kwargs)

        dyn_args = tuple(args[i] for i in dyn_idx)
        try:
            # Values fn closes over that are being differentiated (tracers) become explicit inputs, so the
            # custom_vjp below sees them and gradients reach them; as inputs they are never offloaded.
            converted, consts = jax.closure_convert(f_dyn, dyn_args, dyn_kw)
        except TypeError as e:
            if "static" in str(e) or "valid JAX type" in str(e):
                raise TypeError(f"jaxvmm.checkpoint: an argument is not an array ({e}); mark Python-valued "
                                "arguments with static_argnums (positional) or static_argnames (keyword)") from e
            raise
        cse = prevent_cse if isinstance(prevent_cse, bool) else (prevent_cse, True) + (False,) * len(consts)
        ckpt = jax.checkpoint(converted, policy=jax_policy, prevent_cse=cse)
        layout = {}  # filled while the forward rule is traced; read by the backward rule

        @jax.custom_vjp
        def run(*dyn):
            return ckpt(*dyn)

        def fwd(*dyn):
            flat, in_tree = jax.tree.flatten(dyn)

            def traced(*flat):
                out, vjp_fn = jax.vjp(ckpt, *jax.tree.unflatten(in_tree, flat))
                out_leaves, layout["out_tree"] = jax.tree.flatten(out)
                res_leaves, layout["res_tree"] = jax.tree.flatten(vjp_fn)
                layout["n_out"] = len(out_leaves)
                return out_leaves, res_leaves

            closed = jax.make_jaxpr(traced)(*flat)
            n_out = layout["n_out"]
            tagged = [_is_host(v.aval) for v in closed.jaxpr.outvars[n_out:]]
            vals = _core.eval_jaxpr(_retype(closed.jaxpr), closed.consts, *flat)
            out, leaves = vals[:n_out], vals[n_out:]
            tie = next((x for x in jax.tree.leaves(dyn[:2]) if isinstance(x, jax.Array)), None)
            res, kinds = [], []
            for leaf, offload in zip(leaves, tagged):
                if offload and _offloadable(leaf, spec):
                    if tie is not None:
                        # Tie the offload to this call's own inputs: a residual that depends only on
                        # loop constants would otherwise be offloaded once outside lax.scan while its
                        # reload (which waits for the cotangent) runs every iteration.
                        leaf = jax.lax.optimization_barrier((leaf, tie))[0]
                    res.append(_offload_token(leaf))
                    kinds.append((leaf.shape, leaf.dtype, ops._mesh_for(leaf) is not None))
                else:
                    res.append(leaf)
                    kinds.append(None)
            layout["kinds"], layout["tagged"] = kinds, tagged
            return jax.tree.unflatten(layout["out_tree"], out), tuple(res)

        def bwd(res, g):
            kinds = layout["kinds"]
            # Reloads wait for the cotangent: without this XLA may schedule them right after the offloads
            # (outside lax.scan it does), which would keep every residual on the device all along.
            # The dependency is arithmetic that leaves every token bit unchanged whatever g holds (inf and
            # nan included; see ops._tie_leaf); XLA:CPU drops optimization barriers before scheduling.
            tokens = iter(ops._tie([r for r, k in zip(res, kinds) if k is not None], jax.tree.leaves(g), small=True))
            leaves = [r if k is None else ops.reload(ops.Ticket(next(tokens), *k)) for r, k in zip(res, kinds)]
            vjp_fn = jax.tree.unflatten(layout["res_tree"], leaves)
            if not any(layout["tagged"]):
                return vjp_fn(g)
            # The VJP function's jaxpr still types the offloaded residuals as host values and moves them
            # back with device_put: rewrite it so the reloaded (device) values flow in as they are.
            return _call_retyped(vjp_fn, g)

        run.defvjp(fwd, bwd)
        try:
            return run(dyn_args, dyn_kw, *consts)
        except TypeError as e:
            if "forward-mode autodiff" in str(e):
                raise TypeError(_FORWARD_MODE) from e
            raise

    return wrapped


remat = checkpoint
