"""Every use jaxvmm makes of JAX's private modules (``jax._src``), in one place.

``jaxvmm.checkpoint`` (jaxvmm/remat/) is ``jax.checkpoint`` with two of its ``remat`` rules replaced,
and keeps the tickets whose tokens reach Python through a few of JAX's internal functions: none of
that has a public API. Everything it needs from JAX's internals is named here; the rest of jaxvmm
imports it from this module only (tests/test_layering.py checks that no other file names ``jax._src``).

Tested on jax 0.10.2 (CI installs the newest jax on PyPI) and jax 0.11.2 (the GPU machine). Where the
two differ, the code using these names says so (e.g. the parameter names of ``_vjp3_callable``, the
binders of a linear jaxpr's residuals); a JAX whose internals moved fails here, at import, by name.
"""

from __future__ import annotations

import jax
from jax._src import ad_checkpoint as _adc
from jax._src import ad_util as _ad_util
from jax._src import api as _api
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects
from jax._src import source_info_util as _source_info_util
from jax._src import util as _util
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax

# ---- jaxprs, types and tracers ----
Jaxpr = _core.Jaxpr
Var = _core.Var
DropVar = _core.DropVar
Literal = _core.Literal
ShapedArray = _core.ShapedArray
Tracer = _core.Tracer
eval_jaxpr = _core.eval_jaxpr
positional_effects = _core.positional_effects
typeof = getattr(jax, "typeof", None) or _core.typeof
HOST_MEMORY = _core.MemorySpace.Host  # the memory space of a residual a policy marked offloadable
DEVICE_MEMORY = _core.MemorySpace.Device
partition_list = _util.partition_list
split_list = _util.split_list

# ---- primitives ----
device_put_p = _dispatch.device_put_p
reduce_precision_p = _lax.reduce_precision_p
name_p = _adc.name_p  # checkpoint_name
remat_p = _adc.remat_p  # jax.checkpoint

# ---- automatic differentiation ----
Zero = _ad_util.Zero  # a symbolic zero (co)tangent
JVPTracer = _ad.JVPTracer
LinearizeTracer = getattr(_ad, "LinearizeTracer", _ad.JVPTracer)
primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
is_undefined_primal = _ad.is_undefined_primal

# ---- partial evaluation, as remat_partial_eval does it ----
Saveable = _pe.Saveable  # a policy's answers (jax.ad_checkpoint re-exports none of them)
Recompute = _pe.Recompute
Offloadable = _pe.Offloadable
partial_eval_jaxpr_custom = _pe.partial_eval_jaxpr_custom
dce_jaxpr = _pe.dce_jaxpr
JaxprTracer = _pe.JaxprTracer
PartialVal = _pe.PartialVal
new_eqn_recipe = _pe.new_eqn_recipe
remat_allowed_effects = _effects.remat_allowed_effects
insert_reduce_precision = _adc._insert_reduce_precision
checkpoint_logger = _adc.logger  # JAX's residual log


def saved_residuals(jaxpr, arg_names) -> list:
    """JAX's description of the residuals ``jaxpr`` returns (jaxvmm's hook when installed)."""
    return _adc._saved_residuals(jaxpr, arg_names)


def log_checkpoint_residuals() -> bool:
    """The ``jax_log_checkpoint_residuals`` flag."""
    return bool(_config.log_checkpoint_residuals.value)


def remat3_on() -> bool:
    """Whether ``jax.checkpoint`` would take JAX's ``jax_remat3`` path now (it decides when it wraps)."""
    flag = getattr(_config, "remat3", None)
    return bool(getattr(flag, "value", False))


def current_source_info():
    return _source_info_util.current()


def summarize_source_info(source_info) -> str:
    return _source_info_util.summarize(source_info)


def require_devices_during_lowering(prim) -> None:
    """Lowering ``prim`` needs the program's devices (as a custom_partitioning call does)."""
    getattr(_dispatch, "prim_requires_devices_during_lowering", set()).add(prim)


# ---- where jaxvmm hooks into JAX: the rules it replaces and the functions it wraps ----
def remat_rules() -> tuple:
    """JAX's partial-evaluation and transpose rules of ``remat`` in force (jaxvmm's once installed)."""
    return _pe.custom_partial_eval_rules[remat_p], _ad.fancy_transposes[remat_p]


def set_remat_rules(partial_eval, transpose) -> None:
    _pe.custom_partial_eval_rules[remat_p] = partial_eval
    _ad.fancy_transposes[remat_p] = transpose


def ad_linearize():
    """``ad.linearize`` in force (behind ``jax.vjp``, ``jax.linearize`` and ``jax.grad``)."""
    return _ad.linearize


def set_ad_linearize(fn) -> None:
    _ad.linearize = fn


def api_function(name: str):
    """``jax._src.api.<name>`` (``_vjp3_callable``, ``_lift_linearized``), or None in a JAX without it."""
    return getattr(_api, name, None)


def set_api_function(name: str, fn) -> None:
    setattr(_api, name, fn)


VJP = getattr(_api, "VJP", None)  # the function jax.vjp returns (a class since jax 0.10), or None


def saved_residuals_function():
    """``ad_checkpoint._saved_residuals`` in force (behind ``jax.ad_checkpoint.saved_residuals``), or None."""
    return getattr(_adc, "_saved_residuals", None)


def set_saved_residuals_function(fn) -> None:
    _adc._saved_residuals = fn
