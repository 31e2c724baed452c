"""Policies for ``jaxvmm.checkpoint``: what to save (a ``jax.checkpoint`` policy) and which of the saved
residuals leave the device through jaxvmm.

    jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_only_these_names("mlp_hidden"))
    jaxvmm.checkpoint(layer, policy=jaxvmm.policies.offload_everything_saveable(min_bytes=1 << 20))
    jaxvmm.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)   # what it saves is offloaded

Residuals that are inputs of the checkpointed function (parameters, the layer input itself) are kept
on the device: they live in the caller anyway. To offload a layer input, name it inside the layer
(``x = checkpoint_name(x, "block_input")``) and offload that name.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import jax

DEFAULT_MIN_BYTES = 64 << 10


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """``save`` is a ``jax.checkpoint`` policy; saved residuals of at least ``min_bytes`` bytes are
    offloaded (all of them, or only those produced under one of ``names`` when names are given)."""

    save: Callable
    min_bytes: int = DEFAULT_MIN_BYTES
    names: frozenset | None = None
    description: str = ""

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


def offload_only_these_names(*names: str, min_bytes: int = 0) -> OffloadPolicy:
    """Save exactly the values tagged with ``jax.ad_checkpoint.checkpoint_name(x, name)`` for these
    names and offload them; everything else is recomputed in the backward pass."""
    if not names:
        raise ValueError("jaxvmm.policies.offload_only_these_names: give at least one name")
    for n in names:
        if not isinstance(n, str) or not n:
            raise TypeError(f"jaxvmm.policies.offload_only_these_names: names must be non-empty str, got {n!r}")
    return OffloadPolicy(save=jax.checkpoint_policies.save_only_these_names(*names),
                         min_bytes=_check_min_bytes(min_bytes), names=frozenset(names),
                         description=f"offload_only_these_names{tuple(names)!r}")


def offload_everything_saveable(*, min_bytes: int = DEFAULT_MIN_BYTES) -> OffloadPolicy:
    """Save everything ``jax.checkpoint`` can save and offload every saved residual of at least
    ``min_bytes`` bytes (smaller ones stay on the device)."""
    return OffloadPolicy(save=jax.checkpoint_policies.everything_saveable, min_bytes=_check_min_bytes(min_bytes),
                         description=f"offload_everything_saveable(min_bytes={min_bytes})")


def resolve(policy) -> OffloadPolicy:
    """``None`` (save nothing, like ``jax.checkpoint``'s default), an :class:`OffloadPolicy`, or any
    ``jax.checkpoint_policies`` policy (what it saves, above the default size threshold, is offloaded)."""
    if policy is None:
        return OffloadPolicy(save=jax.checkpoint_policies.nothing_saveable, description="nothing_saveable")
    if isinstance(policy, OffloadPolicy):
        return policy
    if policy in (offload_only_these_names, offload_everything_saveable):
        raise TypeError(f"jaxvmm.checkpoint: call the policy factory: policy=jaxvmm.policies.{policy.__name__}(...)")
    if callable(policy):
        return OffloadPolicy(save=policy, description=getattr(policy, "__name__", repr(policy)))
    raise TypeError(f"jaxvmm.checkpoint: policy must be None, a jaxvmm.policies policy or a jax.checkpoint_policies "
                    f"policy, not {type(policy).__name__}")
