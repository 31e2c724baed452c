"""Graph mode vs module loads: before the first run of a newly compiled program, pending graph-mode
rounds are let finish.

XLA loads a program's CUDA module on its first run, and a module load may wait for the device to drain
while holding the CUDA context's lock. A graph-mode round pending on the device (a scan body captured
into a command buffer) waits for the poller, whose next CUDA call would queue behind that lock: a
deadlock (ffi/DESIGN.md, "Graph mode", module loads). jax reports every backend compile, and every
executable taken from the persistent compilation cache, before it runs the program; on those events
each engine whose call sites were captured waits for the device to drain, holding no lock, so the
poller can finish the rounds first. Programs compiled ahead of time (``.lower().compile()``) and first
run later are not covered: block on the earlier program before their first run.
"""

from __future__ import annotations

import threading
import warnings

from ._native import lib

EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")

_lock = threading.Lock()
_installed = False
waits = 0  # engines that waited (diagnostics and tests)


def _on_duration(event: str, duration: float, **kwargs) -> None:
    global waits
    if event not in EVENTS:
        return
    try:
        waits += lib.engines_quiesce_for_module_load()
    except Exception as e:  # noqa: BLE001  (never break a compile; the error is the device's, reported later too)
        warnings.warn(f"jaxvmm: could not wait for graph-mode rounds before a module load: {e}", stacklevel=2)


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        from jax import monitoring

        monitoring.register_event_duration_secs_listener(_on_duration)
        _installed = True
