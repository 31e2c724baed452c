"""jaxvmm: fixed-address memory slots for JAX.

A :class:`Slot` is a virtual address range that stays put while its physical pages are released to
the driver and mapped again, so anything that captured the address (a CUDA graph, an XLA command
buffer) stays valid. On CUDA devices the real driver's virtual memory management is used; on the
jax ``cpu`` platform a POSIX backend gives the same semantics with host pages.
"""

from __future__ import annotations

import dataclasses

from . import errors
from ._devices import target_of
from ._native import lib as _lib
from .errors import (
    BackendUnavailableError,
    DriverError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
    OutOfMemoryError,
    QuarantinedError,
    SlotStateError,
    StaleHandleError,
    VmmError,
)
from ._lifetimes import collect, synchronize
from ._order import after
from ._ticket import Ticket
from .ops import check, configure, engine_stats, offload, prefetch, reload, reserve_host, trim
from .slots import Slot
from . import memory
from .memory import Ballast, MemoryTimeline, host_stats, memory_timeline, reset_peaks
from . import share
from .share import ShareHandle, recv_handle, send_handle
from .remat import checkpoint, policies, print_saved_residuals, remat, saved_residuals
from . import _module_loads

_module_loads.install()

__version__ = "0.1.0"


@dataclasses.dataclass(frozen=True)
class CudaStatus:
    """Whether the CUDA driver is usable; truthy when it is. ``reason`` says why not."""

    available: bool
    reason: str
    driver_version: int

    def __bool__(self) -> bool:
        return self.available


def cuda_available() -> CudaStatus:
    """Load the NVIDIA driver (``libcuda.so.1``, resolved at run time) and report whether jaxvmm can use it."""
    ok, reason, version = _lib.backend_status("cuda")
    return CudaStatus(bool(ok), "" if ok else str(reason), int(version))


def driver_memory_info(device=None) -> tuple[int, int]:
    """``(free, total)`` bytes: ``cuMemGetInfo`` for a CUDA device, the kernel's MemAvailable/MemTotal for cpu."""
    t = target_of(device)
    free, total = _lib.memory_info(t.backend, t.ordinal)
    return int(free), int(total)


def _platform_name(backend: str) -> str:
    return "cuda" if backend == "cuda" else "cpu"


def stats() -> dict:
    """Process-wide slot accounting.

    Keys: ``slots`` (open), ``reserved_bytes``, ``mapped_bytes``, ``peak_mapped_bytes``, ``created``,
    ``closed``, ``releases``, ``remaps``, ``quarantined`` (count), ``quarantined_bytes``, ``quarantine``
    (one dict per quarantined slot: slot, address, size, error, attempts), ``leaked``, ``devices``
    (the same byte counts per ``"cuda:N"``/``"cpu:N"``), ``driver`` (live physical handles,
    reservations and mappings counted at the driver seam, per backend in use) and ``share`` (``exports``,
    ``imports``, ``imported_slots`` open, live zero-copy ``views``, ``channel_fds`` held by exportable
    slots, ``fds`` held by share handles and imported slots), ``offload`` (``engine_stats()``) and ``host``
    (pinned host memory of the offload engines, summed over devices, see ``jaxvmm.memory.host_stats``:
    ``in_use_bytes`` now, ``peak_in_use_bytes`` since start, ``window_peak_in_use_bytes`` since the last
    ``jaxvmm.reset_peaks()``, ``pinned_bytes`` held from the driver, ``limit_bytes``).
    """
    s = dict(_lib.stats())
    s["devices"] = {f"{_platform_name(b)}:{d}": dict(v) for (b, d), v in s["devices"].items()}
    driver = {}
    for backend in ("posix", "cuda"):
        c = _lib.driver_counters(backend)
        if any(c["calls"].values()):
            driver[_platform_name(backend)] = {k: c[k] for k in ("live_handles", "live_reservations", "live_mappings")}
    s["driver"] = driver
    s["share"] = dict(_lib.share_stats())
    s["share"]["fds"] = share.open_fds()
    s["offload"] = engine_stats()
    s["host"] = host_stats()
    return s


def reset_peak_stats() -> None:
    """Set ``peak_mapped_bytes`` (process-wide and per device) to the bytes mapped now."""
    _lib.reset_peak()


def retry_quarantine() -> int:
    """Retry every quarantined teardown now; returns how many remain quarantined.

    Quarantined teardowns are also retried (at most every 100 ms) whenever a new slot is created."""
    return int(_lib.retry_quarantine())


__all__ = [
    "Slot",
    "ShareHandle",
    "send_handle",
    "recv_handle",
    "share",
    "Ticket",
    "offload",
    "reload",
    "after",
    "prefetch",
    "check",
    "synchronize",
    "configure",
    "reserve_host",
    "engine_stats",
    "checkpoint",
    "remat",
    "policies",
    "saved_residuals",
    "print_saved_residuals",
    "CudaStatus",
    "cuda_available",
    "driver_memory_info",
    "stats",
    "retry_quarantine",
    "reset_peak_stats",
    "reset_peaks",
    "memory",
    "memory_timeline",
    "MemoryTimeline",
    "host_stats",
    "Ballast",
    "errors",
    "VmmError",
    "InvalidArgumentError",
    "NotSupportedError",
    "BackendUnavailableError",
    "DriverError",
    "OutOfMemoryError",
    "QuarantinedError",
    "SlotStateError",
    "StaleHandleError",
    "NotFoundError",
    "InternalError",
]
