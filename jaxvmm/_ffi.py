"""Registers the native XLA FFI targets (``jaxvmm_offload``, ``jaxvmm_reload``, ``jaxvmm_prefetch``)
for the ``CUDA`` and ``cpu`` platforms, once, at import.

On CUDA the handlers are registered in *graph mode* unless ``JAXVMM_GRAPH=0``: their execute stage is
marked command-buffer compatible (XLA may capture it into a CUDA graph and replay it without calling
it), and offload/reload also register an initialize stage, which XLA runs on the host once per
execution and which prepares the call site's channel (``ffi/graph_mode.cc``)."""

from __future__ import annotations

import jax

from . import _config
from ._native import lib

TARGETS = ("jaxvmm_offload", "jaxvmm_reload", "jaxvmm_prefetch")


def graph_mode() -> bool:
    """Whether the CUDA handlers were registered as capturable (``JAXVMM_GRAPH``, on by default)."""
    return _config.read_at_import("graph")


def _register() -> None:
    graph = graph_mode()
    for name, platform, execute, graph_execute, initialize in lib.handlers():
        if graph and graph_execute is not None:
            stages = {"execute": graph_execute}
            if initialize is not None:
                stages["initialize"] = initialize
            jax.ffi.register_ffi_target(name, stages, platform=platform)
        else:
            jax.ffi.register_ffi_target(name, execute, platform=platform)


_register()
