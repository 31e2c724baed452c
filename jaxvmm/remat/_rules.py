"""How ``jaxvmm.checkpoint`` hooks into ``jax.checkpoint``.

``jaxvmm.checkpoint(fun, policy=P)`` *is* ``jax.checkpoint(fun, policy=VmmPolicy(P))``: the same
``remat`` primitive, so everything ``jax.checkpoint`` composes with (``jax.jvp``, ``jax.linearize``,
``jacfwd``, ``vmap``, higher order, effects, refs, its trace cache, ``saved_residuals``) is JAX's own.
A :class:`VmmPolicy` answers like ``P`` with every ``Offloadable`` normalized to device -> pinned_host.

Residuals are created in exactly one place: the partial evaluation of a ``remat`` application (what
``jax.grad``/``jax.vjp``/``jax.linearize`` do to it, directly or inside ``jit``/``scan``/``cond``).
For a ``remat`` whose policy is a :class:`VmmPolicy`, :func:`_partial_eval` replaces JAX's rule: it
runs JAX's own policy-driven split, in which each residual the policy marked offloadable comes out of
a ``device_put`` to the host memory space (its type says ``memory_space=Host``: the tag). Those
``device_put`` calls are removed again (the value stays where it is), tagged residuals are offloaded
through jaxvmm (their ticket tokens become the residuals) and the staged (backward) ``remat`` starts
by reloading them. :func:`_transpose` orders those reloads after the cotangents exist. Every other
``remat`` goes to JAX's rules untouched.

A residual that is itself being differentiated by an outer transformation (the inner residuals of
``jax.grad(jax.grad(f))``, ``jax.jvp(jax.grad(f))``, ``jax.hessian``) stays on the device: an integer
ticket cannot carry its derivative. Values are the same either way. When the first derivative was
staged before the outer transformation sees it (``jax.hessian(jax.jit(f))``), the offload is already
in a jaxpr: the residual's tangent (forward mode) or cotangent (reverse mode) goes through tickets too
(see *derivatives of a staged first derivative*).

Lifetimes: a ticket whose token reaches Python is *kept* (reloads do not consume it; it is freed when
the last array holding its token dies). That is every ticket among the residuals of a function that
``jax.vjp``/``jax.linearize``/``jax.grad`` return outside any trace, wherever its offload ran: op by op
(kept when made), or inside a compiled program (``jax.vjp(jax.jit(f))``, an eager ``lax.scan``: kept when
``ad.linearize`` hands the residuals over, see :func:`_linearize`; a function a jitted program returns:
kept when it is called, see :func:`_install_api_hooks`), and every ticket a reload evaluates eagerly. So
the returned function may be called, or jitted and called, any number of times. A ticket whose token
never leaves a compiled program (``jax.jit(jax.grad(f))``) is consumed by its reload there.
"""

from __future__ import annotations

import typing

import jax
import jax.extend.core
import numpy as np
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir

from .. import _jax_compat as _jc
from .. import _lifetimes, _order, errors, ops
from .._ticket import Ticket

_HOST = _jc.HOST_MEMORY
_DEVICE = _jc.DEVICE_MEMORY


class VmmPolicy:
    """The policy JAX sees for a ``jaxvmm.checkpoint``: the user's answers, checked, with
    ``Offloadable`` normalized to device -> pinned_host (jaxvmm ignores the memory kinds the user
    named). ``spec`` is the resolved :class:`~jaxvmm.policies.OffloadPolicy` (``min_bytes``)."""

    __slots__ = ("spec", "__weakref__")

    def __init__(self, spec):
        self.spec = spec

    def __call__(self, prim, *avals, **params):
        from .policies import Offloadable, Recompute, Saveable

        if prim in (reload_p, shadow_p, tangent_offload_p, tangent_reload_p):
            # An outer differentiation of a backward pass: the reloaded value is saved, never recomputed
            # (recomputing would reload the ticket a second time); a shadow stays a device value (its
            # tangent is the ticket of the residual's tangent).
            return True
        case = self.spec.policy(prim, *avals, **params)
        if isinstance(case, (bool, np.bool_)):
            return bool(case)
        if case is Saveable or case is Recompute:
            return case
        if isinstance(case, Offloadable):
            return _TAG
        if case is Offloadable or callable(case):
            hint = (" (Offloadable must be instantiated: Offloadable(src='device', dst='pinned_host'))"
                    if case is Offloadable else
                    " (a function: was a policy factory passed without being called, or does the policy "
                    "return a policy?)")
        else:
            hint = ""
        raise TypeError(f"jaxvmm.checkpoint: the policy {self.spec!r} answered {case!r} for primitive {prim}"
                        f"{hint}; a policy must return a bool, jaxvmm.policies.Saveable, jaxvmm.policies.Recompute "
                        "or jaxvmm.policies.Offloadable(src, dst)")

    def __repr__(self) -> str:
        return f"jaxvmm.checkpoint policy {self.spec!r}"


_TAG = _jc.Offloadable(src="device", dst="pinned_host")


# ---- a dependency that vmap does not batch ----
# tie(x, *deps) is x, computed after every dep exists. Under vmap the result keeps x's batching: a
# ticket token tied to batched cotangents (jax.jacrev, vmap of a VJP function) stays one token, so
# its reload runs once.
tie_p = jax.extend.core.Primitive("jaxvmm_tie")
tie_p.def_impl(lambda x, *deps: x)
tie_p.def_abstract_eval(lambda x, *deps: x)
_mlir.register_lowering(tie_p, _mlir.lower_fun(
    lambda x, *deps: _order.tie([x], list(deps), small=True)[0], multiple_results=False))
_batching.primitive_batchers[tie_p] = lambda args, dims: (tie_p.bind(*args), dims[0])
_jc.primitive_jvps[tie_p] = lambda primals, tangents: (tie_p.bind(*primals), tangents[0])


def _tie(x, deps):
    deps = [d for d in deps if isinstance(d, (jax.Array, _jc.Tracer)) and getattr(d, "size", 0)
            and getattr(d, "dtype", None) != jax.dtypes.float0]
    return tie_p.bind(x, *deps) if deps else x


# ---- rewriting host-tagged jaxprs ----
def _is_host(aval) -> bool:
    return getattr(aval, "memory_space", None) is _HOST


def _retype_param(p):
    if isinstance(p, jax.extend.core.ClosedJaxpr):
        j = _retype(p.jaxpr)
        return p if j is p.jaxpr else jax.extend.core.ClosedJaxpr(j, p.consts)
    if isinstance(p, _jc.Jaxpr):
        return _retype(p)
    if isinstance(p, (tuple, list)) and any(isinstance(q, (_jc.Jaxpr, jax.extend.core.ClosedJaxpr)) for q in p):
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
        if isinstance(v, _jc.Literal):
            return v
        got = env.get(v)
        if got is not None:
            return got
        nv = v
        if _is_host(v.aval):
            aval = v.aval.update(memory_space=_DEVICE)
            nv = _jc.DropVar(aval) if isinstance(v, _jc.DropVar) else _jc.Var(aval)
            changed = True
        env[v] = nv
        return nv

    constvars = [new(v) for v in jaxpr.constvars]
    invars = [new(v) for v in jaxpr.invars]
    eqns = []
    for eqn in jaxpr.eqns:
        ins = [new(v) for v in eqn.invars]
        if eqn.primitive is _jc.device_put_p:
            devices = eqn.params["devices"]
            to_host = all(d is _HOST for d in devices)
            back = all(d is _DEVICE for d in devices) and all(_is_host(v.aval) for v in eqn.invars)
            if to_host or back:
                changed = True
                for o, i in zip(eqn.outvars, ins):
                    if not isinstance(o, _jc.DropVar):
                        env[o] = i
                continue
        params = {k: _retype_param(p) for k, p in eqn.params.items()}
        if params.get("memory_space") is _HOST:  # e.g. an instantiated zero residual (empty2) made on the host
            params["memory_space"] = _DEVICE
        if any(params[k] is not eqn.params[k] for k in params):
            changed = True
        outs = [new(v) for v in eqn.outvars]
        eqns.append(eqn.replace(invars=ins, outvars=outs, params=params))
    outvars = [new(v) for v in jaxpr.outvars]
    if not changed:
        return jaxpr
    return jaxpr.replace(constvars=constvars, invars=invars, outvars=outvars, eqns=eqns)


# ---- which residuals leave ----
def _differentiated(x) -> bool:
    """Whether ``x`` carries a derivative of an outer transformation (then its ticket could not)."""
    while isinstance(x, _jc.Tracer):
        if isinstance(x, (_jc.JVPTracer, _jc.LinearizeTracer)):
            return True
        inner = getattr(x, "val", None)  # vmap's tracer wraps the value it batches
        if inner is None:
            return False
        x = inner
    return False


def _offloadable(x, spec) -> bool:
    aval = getattr(x, "aval", None)
    if not isinstance(aval, _jc.ShapedArray) or _differentiated(x):
        return False
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) or dtype == jax.dtypes.float0:
        return False
    if not (jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_):
        return False
    nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return nbytes > 0 and nbytes >= spec.min_bytes


_EAGER_OFFLOAD_DIFFERENTIATED = (
    "jaxvmm.checkpoint: internal: a residual offloaded outside any trace is being differentiated; "
    "please report this with the code that raised it")


@jax.custom_jvp
def _offload_token(x):
    return ops.offload(x).token


@_offload_token.defjvp
def _offload_token_jvp(primals, tangents):
    raise TypeError(_EAGER_OFFLOAD_DIFFERENTIATED)


# ---- derivatives of a staged first derivative ----
# A residual offloaded inside a trace (jax.jit, scan, ...) may be differentiated later by a
# transformation applied from outside that trace (jax.hessian(jax.jit(f)): the outer jacfwd pushes
# tangents through the jaxpr of jacrev(f), offloads and reloads included; jax.grad(jax.jit(jax.grad(f)))
# linearizes and transposes it). Its ticket token is an integer (its tangent is float0, which JAX
# drops), and the offload itself is not differentiated (stop_gradient), so such an offload also makes a
# *shadow*: a float32[2] residual (zeros) that travels with the token to its reload. Its tangent is
# tangent_offload_p(x_dot): the bits of the token of a second ticket holding x's tangent, offloaded where
# x is; the reload's JVP gives tangent_reload_p(shadow_dot) as the residual's tangent. No tangent (a
# symbolic zero) means the offload was not differentiated: the reloaded value's tangent is zero.
_SHADOW = _jc.ShapedArray((2,), np.dtype(np.float32))


shadow_p = jax.extend.core.Primitive("jaxvmm_checkpoint_shadow")
_zeros2 = lambda x: jax.numpy.zeros((2,), np.float32)  # noqa: E731
shadow_p.def_impl(_zeros2)
shadow_p.def_abstract_eval(lambda x: _SHADOW)
_mlir.register_lowering(shadow_p, _mlir.lower_fun(_zeros2, multiple_results=False))
_batching.primitive_batchers[shadow_p] = lambda args, dims: (shadow_p.bind(*args), None)


# The tangent of an offloaded residual as a ticket, linear in the tangent: tangent_offload_p(x_dot) is the
# float32[2] bits of the token of a ticket holding x_dot; tangent_reload_p(t) brings it back. Each is the
# other's transpose (reverse mode over a staged first derivative: the cotangent of the reloaded tangent
# is offloaded where the reload was, and reloaded where the offload was).
tangent_offload_p = jax.extend.core.Primitive("jaxvmm_checkpoint_tangent_offload")
tangent_reload_p = jax.extend.core.Primitive("jaxvmm_checkpoint_tangent_reload")


def _tangent_offload(x):
    token = ops.offload(x).token
    if jax.numpy.ndim(token) > 1:
        raise errors.InvalidArgumentError(
            "jaxvmm.checkpoint: a residual offloaded as a sharded ticket (an array sharded over several devices "
            "under plain jit) is being differentiated again from outside its staged first derivative; put jax.jit "
            "outside the derivatives, or save that residual (jax.checkpoint_policies.save_only_these_names)",
            code="invalid_argument")
    bits = jax.lax.bitcast_convert_type(token, np.float32)
    if isinstance(bits, jax.Array) and not isinstance(bits, _jc.Tracer):
        _lifetimes.track(bits)  # evaluated eagerly: the ticket lives while its (float) token array does
    return bits


def _tangent_reload(t, *, shape, dtype):
    return ops.reload(Ticket(jax.lax.bitcast_convert_type(t, np.uint32), shape, dtype))


tangent_offload_p.def_impl(_tangent_offload)
tangent_offload_p.def_abstract_eval(lambda x: _SHADOW)
_mlir.register_lowering(tangent_offload_p, _mlir.lower_fun(_tangent_offload, multiple_results=False))
_batching.primitive_batchers[tangent_offload_p] = lambda args, dims: (
    jax.vmap(_tangent_offload, in_axes=dims[0])(args[0]) if dims[0] is not None else tangent_offload_p.bind(args[0]),
    0 if dims[0] is not None else None)
tangent_reload_p.def_impl(_tangent_reload)
tangent_reload_p.def_abstract_eval(lambda t, *, shape, dtype: _jc.ShapedArray(shape, dtype))
_mlir.register_lowering(tangent_reload_p, _mlir.lower_fun(_tangent_reload, multiple_results=False))


def _tangent_reload_batch(args, dims, *, shape, dtype):
    if dims[0] is None:
        return tangent_reload_p.bind(args[0], shape=shape, dtype=dtype), None
    return jax.vmap(lambda t: _tangent_reload(t, shape=shape, dtype=dtype), in_axes=dims[0])(args[0]), 0


_batching.primitive_batchers[tangent_reload_p] = _tangent_reload_batch


def _tangent_offload_transpose(ct, x):
    if isinstance(ct, _jc.Zero):
        return [_jc.Zero(x.aval)]
    return [tangent_reload_p.bind(ct, shape=tuple(x.aval.shape), dtype=np.dtype(x.aval.dtype))]


def _tangent_reload_transpose(ct, t, *, shape, dtype):
    if isinstance(ct, _jc.Zero):
        return [_jc.Zero(_SHADOW)]
    return [tangent_offload_p.bind(ct)]


_jc.primitive_transposes[tangent_offload_p] = _tangent_offload_transpose
_jc.primitive_transposes[tangent_reload_p] = _tangent_reload_transpose


def _shadow_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    return shadow_p.bind(x), tangent_offload_p.bind(x_dot)


_jc.primitive_jvps[shadow_p] = _shadow_jvp


class _Offloaded(typing.NamedTuple):
    """How a residual was offloaded (:func:`_offload`), for the reload that opens the staged remat."""

    shape: tuple
    dtype: np.dtype
    sharded: bool  # one ticket per shard (jaxvmm._sharded): its token is uint32[*dims, 2]
    token_aval: object  # the token's type: the staged body's input in the residual's place
    shadow: bool  # traced: the token is followed by its shadow (see *derivatives of a staged first derivative*)


def _offload(residuals, tagged, spec, inputs):
    """Offloads the tagged residuals that can leave; returns (residuals with tokens in their place, each
    followed by its shadow when the offload is traced; per original residual an :class:`_Offloaded`, or
    None for one that stays)."""
    out, infos = [], []
    # stop_gradient: the tie is an ordering, not a data path; it must not give the residual a derivative
    deps = [jax.lax.stop_gradient(x) for x in inputs if isinstance(getattr(x, "aval", None), _jc.ShapedArray)
            and not jax.dtypes.issubdtype(x.aval.dtype, jax.dtypes.extended)]
    for r, tag in zip(residuals, tagged):
        if tag and _offloadable(r, spec):
            if deps:
                # Tie the offload to this call's own inputs: a residual that depends only on loop
                # constants would otherwise be hoisted out of lax.scan (offloaded once) while its reload
                # runs every iteration.
                r = jax.lax.optimization_barrier((r, deps))[0]
            traced = isinstance(r, _jc.Tracer)
            if traced:  # may be differentiated again from outside this trace: with a shadow
                # The token carries no derivative (stop_gradient: JAX drops custom_jvp rules from the known
                # jaxprs it partially evaluates, so the offload must not be differentiated at all); x's
                # derivative travels through the shadow.
                tok, shadow = ops.offload(jax.lax.stop_gradient(r)).token, shadow_p.bind(r)
            else:
                tok = _offload_token(r)
                # An eager jax.vjp / jax.linearize: the token reaches Python inside the returned function,
                # which may be called (or jitted and called) any number of times: its ticket is kept, not
                # consumed by a reload, and freed when the function (the last array holding the token) dies.
                _lifetimes.keep(tok)
            sharded = jax.numpy.ndim(tok) > 1  # uint32[*dims, 2]: one ticket per shard (jaxvmm._sharded)
            out.append(tok)
            if traced:
                out.append(shadow)
            infos.append(_Offloaded(tuple(r.shape), np.dtype(r.dtype), sharded, _jc.typeof(tok), traced))
        else:
            out.append(r)
            infos.append(None)
    return out, infos


# ---- the reload that opens the staged remat ----
# A primitive of its own: evaluated eagerly (a VJP or linearized function called outside jit) it keeps
# the ticket (a kept ticket is not consumed by reloads; it is freed when the last array holding its token
# dies) and goes through jaxvmm.reload's synchronous ticket check. Tokens made eagerly (jax.vjp outside
# jit) are kept when they are made (_partial_eval), and tokens a compiled forward returns among the
# residuals of jax.vjp / jax.linearize when those hand them over (_linearize), so jax.jit(vjp_fn) may be
# called again too. Inside a traced program a reload of a token made in the same program consumes it (no
# leak in a training step). A VJP function a jitted program returns is kept when JAX rebuilds it from
# that program's outputs (_keep_on_construction), and, failing that, when it is first called
# (_install_api_hooks); _CALLED_TWICE is what a JAX that changed those functions gives instead.
reload_p = jax.extend.core.Primitive("jaxvmm_checkpoint_reload")

_CALLED_TWICE = (
    "jaxvmm.checkpoint: this VJP or linearized function was already called once, and its offloaded residuals "
    "were made inside a compiled program that returned the function itself (a jitted function returning "
    "jax.vjp's or jax.linearize's function), and that first call ran inside another compiled program that "
    "took the function as an argument (jax.jit(lambda f, ct: f(ct))(vjp_fn, ct)), which consumed their "
    "tickets. Call the function itself first, eagerly or as jax.jit(vjp_fn) (that keeps them: it may then be "
    "called any number of times, in any way), take jax.vjp / jax.linearize outside jax.jit (jax.vjp(jax.jit(f), "
    "x) keeps them too), or call jax.vjp / jax.linearize again for another evaluation")


def _reload_impl(token, *shadow, shape, dtype, sharded=False):
    # Evaluated eagerly: the token is a Python-held array (a VJP or linearized function's residual) that
    # may be reloaded again; keep its ticket (freed when the token's last array dies).
    try:
        _lifetimes.keep(token)
        return ops.reload(Ticket(token, shape, dtype, sharded))
    except errors.InvalidArgumentError as e:
        if "already reloaded" in str(e) or "reserved" in str(e):
            raise errors.InvalidArgumentError(f"{_CALLED_TWICE} ({e})", code="invalid_argument") from e
        raise


def _reload_batch(args, dims, *, shape, dtype, sharded=False):
    (token, *shadow), (d, *_) = args, dims
    if d is None:
        return reload_p.bind(token, *shadow, shape=shape, dtype=dtype, sharded=sharded), None
    out = jax.vmap(lambda t: ops.reload(Ticket(t, shape, dtype, sharded)), in_axes=d)(token)
    return out, 0


def _reload_abstract(token, *shadow, shape, dtype, sharded=False):
    if not sharded:
        return _jc.ShapedArray(shape, dtype)
    # A sharded ticket's token (uint32[*dims, 2]) is sharded like the data it reloads (jaxvmm._sharded).
    s = getattr(token, "sharding", None)
    spec = getattr(s, "spec", None)
    if s is None or spec is None:
        return _jc.ShapedArray(shape, dtype)
    return _jc.ShapedArray(shape, dtype, sharding=s.update(spec=type(spec)(*tuple(spec)[:len(shape)])))


reload_p.def_impl(_reload_impl)
reload_p.def_abstract_eval(_reload_abstract)
_mlir.register_lowering(reload_p, _mlir.lower_fun(
    lambda token, *shadow, shape, dtype, sharded=False: ops.reload(Ticket(token, shape, dtype, sharded)),
    multiple_results=False))
_batching.primitive_batchers[reload_p] = _reload_batch


def _reload_jvp(primals, tangents, *, shape, dtype, sharded=False):
    """The residual's tangent, from the ticket whose token the shadow's tangent holds (see *derivatives
    of a staged first derivative* above); none when the offload was not differentiated."""
    y = reload_p.bind(*primals, shape=shape, dtype=dtype, sharded=sharded)
    shadow_dot = tangents[1] if len(tangents) > 1 else _jc.Zero(_SHADOW)
    if isinstance(shadow_dot, _jc.Zero):
        return y, _jc.Zero(_jc.ShapedArray(shape, dtype))
    return y, tangent_reload_p.bind(shadow_dot, shape=shape, dtype=np.dtype(dtype))


_jc.primitive_jvps[reload_p] = _reload_jvp
# A sharded reload lowers to a custom_partitioning call, which needs the program's devices while it is
# lowered: say so, as custom_partitioning does for itself (else JAX lowers e.g. an eagerly dispatched
# scan of a backward pass without a device assignment and custom_partitioning asserts).
_jc.require_devices_during_lowering(reload_p)


def _with_reloads(jaxpr, infos):
    """``jaxpr`` (the staged remat body, residuals first) taking ticket tokens in place of the
    offloaded residuals and reloading them first."""
    if not any(infos):
        return jaxpr
    n = len(infos)
    avals = []
    for v, info in zip(jaxpr.invars[:n], infos):
        avals += ([info.token_aval] + [_SHADOW] * info.shadow) if info else [v.aval]
    avals += [v.aval for v in jaxpr.invars[n:]]

    def load(a, shadow, info):
        # The ticket says how it was offloaded (sharded: each device its own shard, jaxvmm._sharded); the
        # reload follows it, whatever context the staged body is later traced or evaluated in.
        return reload_p.bind(a, *shadow, shape=info.shape, dtype=info.dtype, sharded=info.sharded)

    def staged(*args):
        args = list(args)
        res = []
        for info in infos:
            a = args.pop(0)
            if info:
                shadow = [args.pop(0)] if info.shadow else []
                a = load(a, shadow, info)
            res.append(a)
        return _jc.eval_jaxpr(jaxpr, (), *res, *args)

    try:
        closed = jax.make_jaxpr(staged)(*avals)
    except TypeError:  # a jax whose make_jaxpr takes no abstract values: shape/dtype structs
        closed = jax.make_jaxpr(staged)(*[
            a if isinstance(a, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals])
    new = closed.jaxpr
    if closed.consts or new.constvars:  # nothing in a reload is a constant: keep the assumption loud
        raise NotImplementedError("jaxvmm.checkpoint: internal: the backward remat body has constants")
    return new


def _reload_inputs(jaxpr) -> list[int]:
    """Positions of the inputs of ``jaxpr`` that are ticket tokens its reloads read."""
    pos = {v: i for i, v in enumerate(jaxpr.invars)}
    return sorted({pos[v] for e in jaxpr.eqns if _reloads(e) for v in e.invars
                   if v in pos and v.aval.dtype == np.uint32 and v.aval.shape[-1:] == (2,)})


def _reloads(eqn) -> bool:
    """``eqn`` is a jaxvmm reload, or a call (shard_map, custom_partitioning, ...) around one."""
    if eqn.primitive is reload_p or eqn.params.get("target_name") == "jaxvmm_reload":
        return True
    if "partitioning" in eqn.primitive.name:
        return True
    for p in eqn.params.values():
        body = getattr(p, "jaxpr", p)
        if any(_reloads(e) for e in getattr(body, "eqns", ())):
            return True
    return False


# ---- residuals that reach Python: VJP and linearized functions of a compiled forward ----
# jax.vjp / jax.linearize / jax.grad (outside any trace) return a function whose residuals are concrete
# arrays. When the forward ran inside a compiled program (jax.vjp(jax.jit(f)), an eager lax.scan), the
# tickets its offloads made come out of that program as token arrays among those residuals, and the
# backward (a compiled program too) reloads them. The function may be called (or jitted and called) any
# number of times, so those tickets are kept when JAX hands the residuals over (before any backward can
# run), and the lifetime registry frees them when the last array holding their tokens dies.
_jax_linearize = getattr(_jc.ad_linearize(), "__wrapped_by_jaxvmm__", _jc.ad_linearize())


def _sub_jaxprs(params):
    for p in params.values():
        for q in (p if isinstance(p, (tuple, list)) else (p,)):
            if isinstance(q, jax.extend.core.ClosedJaxpr):
                yield q.jaxpr
            elif isinstance(q, _jc.Jaxpr):
                yield q


def _reads_tokens(jaxpr) -> bool:
    """``jaxpr`` (nested jaxprs included) reloads a ticket."""
    for eqn in jaxpr.eqns:
        if eqn.primitive in (reload_p, tangent_reload_p) or eqn.params.get("target_name") == "jaxvmm_reload":
            return True
        if any(_reads_tokens(sub) for sub in _sub_jaxprs(eqn.params)):
            return True
    return False


def _token_reads(jaxpr, origins: dict) -> tuple[set, list]:
    """Which origins reach the token operand of a reload in ``jaxpr`` (nested jaxprs included), and the
    origins each output of ``jaxpr`` may carry. ``origins`` maps variables of ``jaxpr`` to sets of
    origins. Conservative: an equation's outputs carry every origin of its inputs (a token sliced out of a
    scan's stacked tokens, tied, passed through a call); a nested jaxpr's inputs line up with the last
    inputs of its equation (call, remat, scan, cond branches, while body)."""
    env = {v: set(o) for v, o in origins.items() if o}
    hits = set()
    get = lambda v: env.get(v, set()) if not isinstance(v, _jc.Literal) else set()  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        if not any(ins):
            continue
        if eqn.primitive in (reload_p, tangent_reload_p) or eqn.params.get("target_name") == "jaxvmm_reload":
            hits |= ins[0]
        carried = set().union(*ins)
        outs = None
        for sub in _sub_jaxprs(eqn.params):
            n = len(sub.invars)
            if n > len(ins):  # a nested jaxpr whose inputs do not line up: assume it reloads them if it reloads
                if _reads_tokens(sub):
                    hits |= carried
                continue
            h, sub_outs = _token_reads(sub, dict(zip(sub.invars, ins[len(ins) - n:])))
            hits |= h
            if len(sub_outs) == len(eqn.outvars):
                outs = [o | s for o, s in zip(outs, sub_outs)] if outs else sub_outs
        for i, v in enumerate(eqn.outvars):
            o = outs[i] if outs else carried
            if o:
                env[v] = set(o)
    return hits, [get(v) for v in jaxpr.outvars]


def _residual_tokens(jaxpr, consts) -> list:
    """The concrete residuals (constants of the linear ``jaxpr``) that are ticket tokens its reloads read."""
    cands = {}
    # jax <= 0.10 binds them to the jaxpr's constvars; jax 0.11 moved them to its first invars (ad.linearize,
    # _vjp3_callable, _lift_linearized all pass them ahead of the tangents).
    binders = jaxpr.constvars if len(jaxpr.constvars) == len(consts) else jaxpr.invars[:len(consts)]
    for i, (v, c) in enumerate(zip(binders, consts)):
        if (isinstance(c, jax.Array) and not isinstance(c, _jc.Tracer) and c.ndim >= 1 and c.shape[-1] == 2
                and c.dtype in (np.uint32, np.float32) and not c.is_deleted()):
            cands[v] = {i}
    if not cands:
        return []
    hits, _ = _token_reads(jaxpr, cands)
    return [consts[i] for i in sorted(hits)]


def _keep_residual_tokens(jaxpr, consts) -> None:
    for token in _residual_tokens(jaxpr, consts):
        try:
            _lifetimes.keep(token)
        except errors.VmmError:  # not (or no longer) a live ticket: its reload raises the error
            pass


def _linearize(*args, **kwargs):
    """JAX's ``ad.linearize`` (behind ``jax.vjp``, ``jax.linearize`` and ``jax.grad``), keeping the tickets
    whose tokens reach Python among the residuals of the function it returns."""
    _lifetimes._collect()  # the tickets of a function that died since (the last training step's) go first
    out = _jax_linearize(*args, **kwargs)
    try:
        jaxpr, consts = out[2], out[3]
    except (TypeError, IndexError):  # a JAX whose linearize returns something else: leave it alone
        return out
    if isinstance(jaxpr, _jc.Jaxpr) and isinstance(consts, (list, tuple)) and consts:
        _keep_residual_tokens(jaxpr, consts)
    return out


_linearize.__wrapped_by_jaxvmm__ = _jax_linearize


# A function that jax.vjp / jax.linearize made inside a trace and that a jitted program returned (a VJP
# object or a Partial is a pytree: its residuals come out of the program as outputs, not through
# ad.linearize). Its residuals are concrete when it is called (eagerly, or traced by jax.jit(vjp_fn)),
# before any of its reloads runs: the functions it calls then (JAX's api._vjp3_callable and
# _lift_linearized, which get the linear jaxpr and its residuals) keep the tokens first.
# The parameters each hook reads by position (jaxpr, residuals), as each supported jax names them (0.11 renamed
# out_known to out_zeros and added structured residuals after them).
_API_HOOKS = {
    "_vjp3_callable": [("spec", out, "jaxpr", "out_primal_avals", "in_tree", "out_tree", "args_res", "opaque_res")
                       for out in ("out_known", "out_zeros")],
    "_lift_linearized": [("jaxpr", "in_avals", "out_avals", out, "consts") for out in ("out_known", "out_zeros")],
}


def _vjp_residuals(spec, opaque_res) -> list:
    """The linear jaxpr's constants a VJP function holds, in order (None for those that are its primal
    inputs, which are never ticket tokens)."""
    return [None if r.primal else opaque_res[r.idx] for r in spec]


def _keep_call_residuals(name, args) -> None:
    """Keeps the tokens among the concrete residuals of a call of ``api.<name>`` (``_vjp3_callable`` or
    ``_lift_linearized``) with these positional arguments; tracers are left alone."""
    try:
        if name == "_vjp3_callable":
            jaxpr, consts = args[2], _vjp_residuals(args[0], args[7])
        else:
            jaxpr, consts = args[0], list(args[4])
        if isinstance(jaxpr, _jc.Jaxpr):
            _keep_residual_tokens(jaxpr, consts)
    except (AttributeError, IndexError, TypeError):  # a JAX whose functions differ: leave them alone
        pass


def _keep_when_called(name, jax_fn):
    def hook(*args):
        _keep_call_residuals(name, args)
        return jax_fn(*args)

    hook.__wrapped_by_jaxvmm__ = jax_fn
    hook.__name__ = name
    return hook


def _install_api_hooks() -> None:
    import inspect

    for name, signatures in _API_HOOKS.items():
        fn = _jc.api_function(name)
        if fn is None or getattr(fn, "__wrapped_by_jaxvmm__", None) is not None:
            continue
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if any(names[:len(params)] == params for params in signatures):
            _jc.set_api_function(name, _keep_when_called(name, fn))


def _keep_on_construction() -> None:
    """A VJP or linearized function that a jitted program returns is rebuilt from the program's outputs
    (pytree unflattening calls ``api.VJP(...)`` / ``Partial(...)`` with the concrete residuals). Keep its
    tokens right there, before anything can reload them: its first call may be traced inside another
    jitted program that takes the function as an argument (``jax.jit(lambda f, ct: f(ct))(vjp_fn, ct)``),
    where the residuals are tracers and a reload would otherwise consume them."""
    vjp_cls = _jc.VJP
    if vjp_cls is not None and getattr(vjp_cls.__init__, "__wrapped_by_jaxvmm__", None) is None:
        init = vjp_cls.__init__

        def vjp_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            # the arguments its calls pass _vjp3_callable: the partial's, then the object's fields
            fields = [getattr(self, f, None) for f in ("in_tree", "out_tree", "args_res", "opaque_residuals")]
            _keep_call_residuals("_vjp3_callable", (*getattr(self.fun, "args", ()), *fields))

        vjp_init.__wrapped_by_jaxvmm__ = init
        vjp_cls.__init__ = vjp_init

    partial_cls = jax.tree_util.Partial
    if partial_cls is not None and getattr(partial_cls.__new__, "__wrapped_by_jaxvmm__", None) is None:
        new = partial_cls.__new__

        def partial_new(klass, func, *args, **kw):
            obj = new(klass, func, *args, **kw)
            # a functools.partial, or (rebuilt from a pytree) JAX's shim that carries its func/args
            inner = getattr(func, "func", None)
            lifted = _jc.api_function("_lift_linearized")
            if inner is not None and inner in (lifted, getattr(lifted, "__wrapped_by_jaxvmm__", None)):
                _keep_call_residuals("_lift_linearized", (*getattr(func, "args", ()), *args))
            return obj

        partial_new.__wrapped_by_jaxvmm__ = new
        partial_cls.__new__ = staticmethod(partial_new)


def api_hooks_installed() -> dict:
    """Which of jax's internal functions jaxvmm hooks here (a jax whose functions changed shows False: a VJP
    function a jitted program returns is then reloaded once only)."""
    return {name: getattr(_jc.api_function(name), "__wrapped_by_jaxvmm__", None) is not None
            for name in _API_HOOKS}


# ---- the rules ----
_jax_partial_eval, _jax_transpose = _jc.remat_rules()


def _partial_eval(trace, *tracers, jaxpr, prevent_cse, **params):
    """JAX's ``remat_partial_eval`` (same steps, same private helpers), plus the offload of the
    residuals the policy tagged and the reloads that open the staged remat."""
    policy = params["policy"]
    if not isinstance(policy, VmmPolicy):
        return _jax_partial_eval(trace, *tracers, jaxpr=jaxpr, prevent_cse=prevent_cse, **params)
    assert not jaxpr.constvars
    disallowed = _jc.remat_allowed_effects.filter_not_in(jaxpr.effects)
    if disallowed:
        raise NotImplementedError(f"Effects not supported in partial-eval of `checkpoint`/`remat`: {disallowed}")
    in_unknowns = [not t.is_known() for t in tracers]
    jaxpr_known, jaxpr_staged, out_unknowns, out_inst, num_res = _jc.partial_eval_jaxpr_custom(
        jaxpr, in_unknowns, [True] * len(in_unknowns), False, False, policy)
    _, out_inst_unknown = _jc.partition_list(out_inst, out_unknowns)
    jaxpr_unknown, in_used_staged = _jc.dce_jaxpr(jaxpr_staged, out_inst_unknown)
    used_res, in_used_staged = _jc.split_list(in_used_staged, [num_res])
    out_used_known = [True] * (len(out_unknowns) - sum(out_unknowns)) + used_res
    jaxpr_known, in_used_known = _jc.dce_jaxpr(jaxpr_known, out_used_known)
    num_res = sum(used_res)
    # jaxvmm: the residuals the policy tagged are host-typed; run the known side without moving them.
    # Retyped before JAX's reduce_precision pass, so that the pass rounds the value itself (which the
    # primal outputs use too), not a copy of it.
    tagged = [_is_host(v.aval) for v in jaxpr_known.outvars[len(jaxpr_known.outvars) - num_res:]]
    if any(tagged):
        jaxpr_known = _retype(jaxpr_known)
        jaxpr_unknown = _retype(jaxpr_unknown)
    jaxpr_known_ = _jc.insert_reduce_precision(jaxpr_known, num_res)

    in_consts_ = [t.pval.get_known() for t in tracers if t.pval.is_known()]
    _, in_consts = _jc.partition_list(in_used_known, in_consts_)
    out_consts = _jc.eval_jaxpr(jaxpr_known_, (), *in_consts)
    out_knowns, residuals = _jc.split_list(out_consts, [len(out_consts) - num_res])
    # A staged body with inputs other than arrays (refs) keeps its residuals on the device.
    if any(tagged) and all(isinstance(v.aval, _jc.ShapedArray) for v in jaxpr_unknown.invars):
        residuals, infos = _offload(residuals, tagged, policy.spec, in_consts)
        jaxpr_unknown = _with_reloads(jaxpr_unknown, infos)
    else:
        infos = None

    res_tracers = [trace.new_instantiated_const(r) for r in residuals]
    _, tracers_staged = _jc.partition_list(in_used_staged, tracers)
    in_jaxpr_tracers = res_tracers + [trace.instantiate_const(t) for t in tracers_staged]
    out_jaxpr_tracers = [_jc.JaxprTracer(trace, _jc.PartialVal.unknown(x.aval), None) for x in jaxpr_unknown.outvars]
    if isinstance(prevent_cse, tuple):
        _, prevent_cse_ = _jc.partition_list(in_used_staged, prevent_cse)
        prevent_cse = (True,) * len(res_tracers) + tuple(prevent_cse_)
    new_params = dict(params, jaxpr=jaxpr_unknown, differentiated=True, prevent_cse=prevent_cse)
    recipe = _jc.new_eqn_recipe(trace, in_jaxpr_tracers, out_jaxpr_tracers, _jc.remat_p, new_params,
                                _jc.positional_effects(jaxpr_unknown), _jc.current_source_info())
    _log_residuals(tracers, in_used_staged, in_unknowns, jaxpr_unknown, jaxpr_known, num_res, infos)
    for t in out_jaxpr_tracers:
        t.recipe = recipe
    return _merge(out_unknowns, out_knowns, out_jaxpr_tracers)


def _log_residuals(tracers, in_used_staged, in_unknowns, jaxpr_unknown, jaxpr_known, num_res, infos):
    """JAX's residual log (``jax_log_checkpoint_residuals``), offloaded residuals marked as such."""
    import logging

    level = logging.WARNING if _jc.log_checkpoint_residuals() else logging.DEBUG
    logger = _jc.checkpoint_logger
    if not logger.isEnabledFor(level):
        return
    try:
        _, staged_unk = _jc.partition_list(in_used_staged, in_unknowns)
        res_invars, _ = _jc.partition_list(staged_unk, jaxpr_unknown.invars[num_res:])
        res_outvars = jaxpr_known.outvars[len(jaxpr_known.outvars) - num_res:]
        body = _jc.saved_residuals(jaxpr_known.replace(outvars=res_outvars), ("",) * len(jaxpr_known.invars))
        lines = [f"  {v.aval.str_short()}" for v in res_invars]
        head = "remat-decorated function " + "saving inputs with shapes:\n" * bool(res_invars)
        tail = "saving these intermediates:\n" * bool(body)
        inter = [f"  {a.str_short()} from {s}" for a, s in body]
        moved = sum(1 for i in (infos or ()) if i)
        note = f"\n{moved} of these intermediates offloaded through jaxvmm" if moved else ""
        logger.log(level, head + "\n".join(lines) + ("\n" if lines else "") + "and " * bool(lines) * bool(body)
                   + tail + "\n".join(inter) + note)
    except Exception:  # as in JAX: a failure to log never fails the computation
        pass


def _merge(unknowns, knowns, staged):
    knowns, staged = iter(knowns), iter(staged)
    return [next(staged) if u else next(knowns) for u in unknowns]


def _transpose(out_cts, *args, jaxpr, prevent_cse, **params):
    """JAX's ``remat_transpose``, with the ticket tokens the body reloads tied to the cotangents first:
    without the tie XLA may schedule a reload right after its offload (outside ``lax.scan`` it does),
    which would keep the residual on the device all along."""
    if isinstance(params.get("policy"), VmmPolicy):
        which = _reload_inputs(jaxpr)
        if which:
            deps = [ct for ct in out_cts if not isinstance(ct, _jc.Zero)]
            args = list(args)
            for i in which:
                if not _jc.is_undefined_primal(args[i]):
                    args[i] = _tie(args[i], deps)
    return _jax_transpose(out_cts, *args, jaxpr=jaxpr, prevent_cse=prevent_cse, **params)


def install() -> None:
    """Routes ``remat`` applications with a :class:`VmmPolicy` through jaxvmm's rules (others keep JAX's)."""
    _jc.set_remat_rules(_partial_eval, _transpose)
    _jc.set_ad_linearize(_linearize)
    _install_api_hooks()
    _keep_on_construction()


install()
