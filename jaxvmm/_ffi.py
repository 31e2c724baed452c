"""Registers the native XLA FFI targets (``jaxvmm_offload``, ``jaxvmm_reload``, ``jaxvmm_prefetch``)
for the ``CUDA`` and ``cpu`` platforms, once, at import."""

from __future__ import annotations

import jax

from ._native import lib

TARGETS = ("jaxvmm_offload", "jaxvmm_reload", "jaxvmm_prefetch")


def _register() -> None:
    for name, platform, capsule in lib.handlers():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


_register()
