"""Policies for ``jaxvmm.checkpoint``. They mean what ``jax.checkpoint_policies`` policies mean, with
one difference: what a policy marks *offloadable* leaves the device through jaxvmm instead of XLA's
host memory space.

A policy is called on each primitive application of the checkpointed function and answers, as in
JAX:

* ``True`` / ``Saveable``: the value is saved **on the device** (exactly as ``jax.checkpoint`` saves it);
* ``Offloadable(src, dst)``: the value is **offloaded through jaxvmm** and reloaded in the backward pass,
  whatever memory kinds ``src``/``dst`` name (they only matter to XLA's own offload);
* ``False`` / ``Recompute``: the value is recomputed in the backward pass.

So switching from JAX's native offload is one word::

    jax.checkpoint(layer, policy=jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["block_in"], names_which_can_be_offloaded=["hidden"],
        offload_src="device", offload_dst="pinned_host"))
    jaxvmm.checkpoint(layer, policy=jaxvmm.policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["block_in"], names_which_can_be_offloaded=["hidden"]))

Every ``jax.checkpoint_policies`` name is available here too (``jaxvmm.policies.dots_saveable`` is
``jax.checkpoint_policies.dots_saveable``), and ``jaxvmm.checkpoint`` accepts JAX's policy objects as
they are. Two jaxvmm shorthands offload without naming a save/offload split:

    jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names("mlp_hidden"))
    jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_everything_saveable(min_bytes=1 << 20))

Residuals that are inputs of the checkpointed function (parameters, the layer input itself) are never
offloaded: they live in the caller anyway. To offload a layer input, name it inside the layer
(``x = checkpoint_name(x, "block_input")``) and offload that name.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import jax

from .. import _jax_compat as _jc

DEFAULT_MIN_BYTES = 64 << 10

# JAX's answers a policy may give (jax.ad_checkpoint re-exports none of them publicly).
Saveable = _jc.Saveable
Recompute = _jc.Recompute
Offloadable = _jc.Offloadable


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """A jaxvmm policy: ``policy`` is a ``jax.checkpoint`` policy (answers ``True``/``Saveable``,
    ``Offloadable(...)`` or ``False``/``Recompute`` per primitive application); offloadable residuals of
    fewer than ``min_bytes`` bytes stay on the device instead. ``names``: the offloaded names, for
    policies built from names (informational)."""

    policy: Callable
    min_bytes: int = 0
    names: frozenset | None = None
    description: str = ""

    def __call__(self, prim, *avals, **params):
        return self.policy(prim, *avals, **params)

    def __repr__(self) -> str:
        return f"jaxvmm.policies.{self.description or 'OffloadPolicy'}"


def _check_min_bytes(min_bytes) -> int:
    try:
        n = operator.index(min_bytes)
    except TypeError:
        n = -1
    if isinstance(min_bytes, bool) or n < 0:
        raise ValueError(f"jaxvmm.policies: min_bytes must be an int >= 0, got {min_bytes!r}")
    return n


def _check_names(what: str, arg: str, names) -> frozenset:
    if isinstance(names, (str, bytes)) or not hasattr(names, "__iter__"):
        hint = f"; write {arg}=[{names!r}]" if isinstance(names, str) else ""
        raise TypeError(f"jaxvmm.policies.{what}: {arg} must be a list of names (str), got {names!r}{hint}")
    names = list(names)
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"jaxvmm.policies.{what}: {arg} must hold non-empty str, got {n!r}")
    return frozenset(names)


def _check_memory_kind(what: str, arg: str, kind) -> str:
    if not isinstance(kind, str) or not kind:
        raise TypeError(f"jaxvmm.policies.{what}: {arg} must be a memory kind string such as 'device' or "
                        f"'pinned_host', got {kind!r} (jaxvmm ignores it: offloaded values always go through "
                        "jaxvmm's pinned pool)")
    return kind


def _offload_named(names: frozenset):
    name_p = _jc.name_p

    def policy(prim, *_, **params):
        if prim is name_p and params["name"] in names:
            return Offloadable(src="device", dst="pinned_host")
        return Recompute

    return policy


def offload_only_these_names(*names: str, min_bytes: int = 0) -> OffloadPolicy:
    """Offload exactly the values tagged with ``jax.ad_checkpoint.checkpoint_name(x, name)`` for these
    names; everything else is recomputed in the backward pass. Same as
    ``save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=names)``."""
    if not names:
        raise ValueError("jaxvmm.policies.offload_only_these_names: give at least one name")
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"jaxvmm.policies.offload_only_these_names: names must be non-empty str, got {n!r}")
    return OffloadPolicy(policy=_offload_named(frozenset(names)), min_bytes=_check_min_bytes(min_bytes),
                         names=frozenset(names), description=f"offload_only_these_names{tuple(names)!r}")


def _offload_everything(prim, *_, **__):
    return Offloadable(src="device", dst="pinned_host")


def offload_everything_saveable(*, min_bytes: int = DEFAULT_MIN_BYTES) -> OffloadPolicy:
    """Save everything ``jax.checkpoint`` can save (``everything_saveable``) and offload every saved
    residual of at least ``min_bytes`` bytes (smaller ones stay on the device)."""
    return OffloadPolicy(policy=_offload_everything, min_bytes=_check_min_bytes(min_bytes),
                         description=f"offload_everything_saveable(min_bytes={min_bytes})")


def save_and_offload_only_these_names(*, names_which_can_be_saved, names_which_can_be_offloaded,
                                      offload_src: str = "device",
                                      offload_dst: str = "pinned_host") -> OffloadPolicy:
    """``jax.checkpoint_policies.save_and_offload_only_these_names`` under jaxvmm: values named in
    ``names_which_can_be_saved`` stay on the device, those named in ``names_which_can_be_offloaded`` are
    offloaded through jaxvmm, the rest is recomputed. ``offload_src``/``offload_dst`` are accepted for
    compatibility and ignored."""
    what = "save_and_offload_only_these_names"
    saved = _check_names(what, "names_which_can_be_saved", names_which_can_be_saved)
    offloaded = _check_names(what, "names_which_can_be_offloaded", names_which_can_be_offloaded)
    if saved & offloaded:
        raise ValueError(f"jaxvmm.policies.{what}: a name cannot be both saved and offloaded: "
                         f"{sorted(saved & offloaded)}; remove it from one of the two lists")
    _check_memory_kind(what, "offload_src", offload_src)
    _check_memory_kind(what, "offload_dst", offload_dst)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved, names_which_can_be_offloaded=offloaded,
        offload_src=offload_src, offload_dst=offload_dst)
    return OffloadPolicy(policy=policy, names=offloaded,
                         description=f"{what}(names_which_can_be_saved={sorted(saved)}, "
                                     f"names_which_can_be_offloaded={sorted(offloaded)})")


def offload_dot_with_no_batch_dims(offload_src: str = "device", offload_dst: str = "pinned_host") -> OffloadPolicy:
    """``jax.checkpoint_policies.offload_dot_with_no_batch_dims`` under jaxvmm: outputs of matmuls
    without batch dimensions are offloaded through jaxvmm, the rest is recomputed. The memory kinds are
    accepted for compatibility and ignored."""
    what = "offload_dot_with_no_batch_dims"
    _check_memory_kind(what, "offload_src", offload_src)
    _check_memory_kind(what, "offload_dst", offload_dst)
    return OffloadPolicy(policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims(offload_src, offload_dst),
                         description=f"{what}()")


# JAX's own policies, under the same names: they keep their meaning (saved values stay on the device).
everything_saveable = jax.checkpoint_policies.everything_saveable
nothing_saveable = jax.checkpoint_policies.nothing_saveable
dots_saveable = jax.checkpoint_policies.dots_saveable
checkpoint_dots = jax.checkpoint_policies.checkpoint_dots
dots_with_no_batch_dims_saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
checkpoint_dots_with_no_batch_dims = jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
save_anything_except_these_names = jax.checkpoint_policies.save_anything_except_these_names
save_any_names_but_these = jax.checkpoint_policies.save_any_names_but_these
save_only_these_names = jax.checkpoint_policies.save_only_these_names
save_from_both_policies = jax.checkpoint_policies.save_from_both_policies
# Whatever else this JAX has under jax.checkpoint_policies (newer versions add the policy classes
# SaveOnlyTheseNames, SaveAnyNamesButThese, SaveAndOffloadOnlyTheseNames), under the same name.
for _name, _value in vars(jax.checkpoint_policies).items():
    if not _name.startswith("_"):
        globals().setdefault(_name, _value)
del _name, _value

# Factories: passing one without calling it is a mistake resolve() names.
_FACTORIES = {
    offload_only_these_names: "offload_only_these_names(*names)",
    offload_everything_saveable: "offload_everything_saveable()",
    save_and_offload_only_these_names: ("save_and_offload_only_these_names(names_which_can_be_saved=[...], "
                                        "names_which_can_be_offloaded=[...])"),
    offload_dot_with_no_batch_dims: "offload_dot_with_no_batch_dims()",
    jax.checkpoint_policies.save_and_offload_only_these_names: (
        "save_and_offload_only_these_names(names_which_can_be_saved=[...], names_which_can_be_offloaded=[...], "
        "offload_src='device', offload_dst='pinned_host')"),
    jax.checkpoint_policies.offload_dot_with_no_batch_dims: "offload_dot_with_no_batch_dims('device', 'pinned_host')",
    save_anything_except_these_names: "save_anything_except_these_names(*names)",
    save_any_names_but_these: "save_any_names_but_these(*names)",
    save_only_these_names: "save_only_these_names(*names)",
    save_from_both_policies: "save_from_both_policies(policy_1, policy_2)",
}


def resolve(policy) -> OffloadPolicy:
    """``None`` (save nothing, like ``jax.checkpoint``'s default), an :class:`OffloadPolicy`, or any
    ``jax.checkpoint_policies`` policy (kept as it is: what it saves stays on the device, what it marks
    ``Offloadable`` goes through jaxvmm)."""
    if policy is None:
        return OffloadPolicy(policy=jax.checkpoint_policies.nothing_saveable, description="nothing_saveable")
    if isinstance(policy, OffloadPolicy):
        return policy
    try:
        factory = _FACTORIES.get(policy)
    except TypeError:  # unhashable
        factory = None
    if factory is not None:
        where = "jaxvmm.policies" if getattr(policy, "__module__", "") == __name__ else "jax.checkpoint_policies"
        raise TypeError(f"jaxvmm.checkpoint: policy={where}.{policy.__name__} is a policy factory, not a policy: "
                        f"call it, policy={where}.{factory}")
    if isinstance(policy, type):
        raise TypeError(f"jaxvmm.checkpoint: policy must be None, a jaxvmm.policies policy or a "
                        f"jax.checkpoint_policies policy, not the class {policy.__name__} (instantiate it)")
    if callable(policy):
        return OffloadPolicy(policy=policy, description=getattr(policy, "__name__", repr(policy)))
    raise TypeError(f"jaxvmm.checkpoint: policy must be None, a jaxvmm.policies policy or a jax.checkpoint_policies "
                    f"policy, not {type(policy).__name__}")
