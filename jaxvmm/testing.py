"""Test hooks: fault injection at the driver seam and the seam's live-object counters.

Every driver call jaxvmm makes goes through a wrapper that can fail the Nth call of a named entry
point with a chosen ``CUresult`` and counts live physical handles, reservations and mappings. These
hooks are for tests and debugging; they are cheap when nothing is armed.

Importing this module binds the native hooks (``hooks``: the submodule ``jaxvmm._jaxvmm._testing``, from
``ffi/module_testing.cc``); ``import jaxvmm`` alone neither imports this module nor binds them.
"""

from __future__ import annotations

import contextlib

from . import _config
from ._devices import target_of
from ._native import lib

# The native test, replay, benchmark and fault hooks (jaxvmm._jaxvmm._testing), bound now: `import jaxvmm`
# does not bind them.
hooks = lib.load_testing()

# Driver entry points each lifecycle operation calls, in order.
LIFECYCLE_ENTRIES = {
    "create": ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess"),
    "release": ("cuMemUnmap", "cuMemRelease"),
    "remap": ("cuMemCreate", "cuMemMap", "cuMemSetAccess"),
    "close": ("cuMemUnmap", "cuMemRelease", "cuMemAddressFree"),
}

# ... and each sharing operation (Slot.import_ rolls back exactly at each of these; export leaves nothing open).
SHARE_ENTRIES = {
    "import": ("cuMemAddressReserve", "cuMemImportFromShareableHandle", "cuMemGetAllocationPropertiesFromHandle",
               "cuMemMap", "cuMemSetAccess"),
    "export": ("cuMemExportToShareableHandle",),
}


def configure_debug(**settings) -> dict:
    """Set debug settings (process-wide) at run time, as ``jaxvmm.configure`` sets the user ones; returns
    the debug values in force, read back from the core. Each is also a ``JAXVMM_DEBUG_*`` environment
    variable, read at ``import jaxvmm`` (jaxvmm/_config.py):

"""
    return _config.configure(lib, "debug", "configure_debug", settings)


configure_debug.__doc__ = (configure_debug.__doc__ or "") + _config.keywords_doc("debug")


def backend_of(device=None) -> str:
    return target_of(device).backend


def driver_entries() -> list[str]:
    """Every driver entry point in the seam's table."""
    return list(hooks.driver_entries())


def arm_fault(entry: str, *, nth: int = 1, times: int = 1, error: str = "CUDA_ERROR_OUT_OF_MEMORY", device=None) -> None:
    """Fail calls of ``entry``: the ``nth`` next call and the ``times - 1`` after it (``times=-1``: until cleared)."""
    if nth < 1:
        raise ValueError("jaxvmm: nth must be >= 1")
    if times == 0 or times < -1:
        raise ValueError("jaxvmm: times must be >= 1 or -1 (forever)")
    hooks.arm_fault(backend_of(device), entry, nth, times, error)


def clear_faults(device=None) -> None:
    hooks.clear_faults(backend_of(device))


@contextlib.contextmanager
def fault(entry: str, *, nth: int = 1, times: int = 1, error: str = "CUDA_ERROR_OUT_OF_MEMORY", device=None):
    """Context manager: arm a fault for the block, clear every fault of the backend after it."""
    arm_fault(entry, nth=nth, times=times, error=error, device=device)
    try:
        yield
    finally:
        clear_faults(device)


def driver_counters(device=None) -> dict:
    """``live_handles``, ``live_reservations``, ``live_mappings``, ``injected`` and per-entry ``calls``."""
    c = dict(lib.driver_counters(backend_of(device)))
    c["calls"] = dict(c["calls"])
    return c


class Replay:
    """Records the engine's offload/reload work on a stream of its own and replays it, without XLA.

    What XLA's command buffers do to a captured handler, made explicit: ``prepare`` is the initialize
    stage (once per "execution"), ``capture()`` records the calls made inside it (the handlers run once,
    under stream capture), and ``launch()`` replays the recorded device work with no handler call.
    Buffers are raw device (cpu: host) addresses, for example of ``jaxvmm.Slot`` objects. Works on the
    POSIX backend (cpu) and on CUDA.
    """

    OFFLOAD, RELOAD = 0, 1

    def __init__(self, device=None):
        t = target_of(device)
        self.backend, self.device = t.backend, t.ordinal
        self.stream = hooks.replay_stream(self.backend, self.device)
        self.graphs: list[int] = []

    def prepare(self, site: int, kind: int, nbytes: int, signature: int = 0) -> None:
        self.stream.prepare(site, kind, nbytes, signature)

    def offload(self, site: int, src: int, nbytes: int, token_out: int, signature: int = 0) -> None:
        self.stream.offload(site, src, nbytes, signature, token_out)

    def reload(self, site: int, token_in: int, dst: int, nbytes: int, signature: int = 0) -> None:
        self.stream.reload(site, token_in, dst, nbytes, signature)

    @contextlib.contextmanager
    def capture(self):
        """Calls inside the block are recorded; yields a list that receives the graph handle."""
        out: list[int] = []
        self.stream.begin()
        try:
            yield out
        finally:
            graph = self.stream.end()
            self.graphs.append(graph)
            out.append(graph)

    def launch(self, graph: int) -> None:
        self.stream.launch(graph)

    def synchronize(self) -> None:
        self.stream.sync()

    def close(self) -> None:
        self.synchronize()
        for g in self.graphs:
            self.stream.destroy(g)
        self.graphs.clear()
        self.stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
