"""Memory measurement: a timeline of device memory in use, pinned host usage and its peaks, and a
ballast that holds device memory so that XLA and jaxvmm share a fixed budget.

Device memory a training step needs is one moment's total: XLA's live buffers plus jaxvmm's mapped
pages *at the same time*. Two separately measured peaks (XLA's ``peak_bytes_in_use`` and jaxvmm's
``peak_mapped_bytes``) only bound it from above. :func:`memory_timeline` samples the driver's used
memory (``cuMemGetInfo``: total - free) together with jaxvmm's mapped bytes, every ~100 us, on a native
thread that never touches Python::

    with jaxvmm.memory_timeline() as tl:
        for _ in range(3):
            loss, params = step(params, batch)
            jax.block_until_ready(loss)
    print(tl.peak_used_bytes - tl.first_used_bytes, tl.internal_at_peak_bytes)

Run the process with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``: XLA's default allocator keeps what it
allocated once (a pool that grows and never shrinks), so the driver sees the pool's high-water mark, not
XLA's live bytes; the platform allocator returns each buffer to the driver when XLA frees it. Also set
``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (the default allocator otherwise takes 75% of the device at start).

On jax's ``cpu`` platform (the POSIX backend) there is no device memory to ask a driver about: the
timeline's used bytes are jaxvmm's mapped bytes on that device, and nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses

from ._devices import target_of
from ._native import lib

DEFAULT_INTERVAL_US = 100
DEFAULT_CAPACITY = 1 << 18  # samples kept (8 MiB; ~26 s at 100 us); the peak covers every sample taken


@dataclasses.dataclass(frozen=True)
class Sample:
    t_s: float          # seconds since the timeline started
    used_bytes: int     # driver: total - free (POSIX: jaxvmm's mapped bytes)
    mapped_bytes: int   # jaxvmm's mapped bytes on the device (every slot)
    internal_bytes: int  # of which jaxvmm's own: staging and graph-mode cells


class MemoryTimeline:
    """Samples one device's memory every ``interval_us`` into a ring of ``capacity`` samples (the newest
    are kept; the peak is tracked over every sample). Start with :meth:`start` (or use
    :func:`memory_timeline`); read the peak and the series during or after; :meth:`close` frees it."""

    def __init__(self, device=None, *, interval_us: float = DEFAULT_INTERVAL_US, capacity: int = DEFAULT_CAPACITY):
        if not interval_us >= 1:
            raise ValueError(f"jaxvmm: memory_timeline: interval_us must be >= 1, got {interval_us!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"jaxvmm: memory_timeline: capacity must be an int >= 1, got {capacity!r}")
        t = target_of(device)
        self.backend, self.ordinal = t.backend, t.ordinal
        self.interval_us = float(interval_us)
        self.capacity = capacity
        self.source = "cuMemGetInfo (total - free)" if t.backend == "cuda" else "jaxvmm mapped bytes (POSIX backend)"
        self._sampler = None  # the native MemorySampler while it runs
        self._final: dict | None = None

    def start(self) -> MemoryTimeline:
        if self._sampler is not None or self._final is not None:
            raise RuntimeError("jaxvmm: this memory timeline was already started")
        self._sampler = lib.start_sampler(self.backend, self.ordinal, self.capacity, int(self.interval_us * 1000))
        return self

    def stop(self) -> None:
        """Stops sampling (one last sample is taken now); the results stay readable."""
        if self._sampler is not None and self._final is None:
            self._sampler.stop()
            self._final = self._summary()
            self._series = bytes(self._sampler.series())
            self._sampler.close()
            self._sampler = None

    close = stop

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def __del__(self):
        try:
            if self._sampler is not None:
                self._sampler.close()
        except Exception:  # noqa: BLE001 (interpreter exit)
            pass

    def _summary(self) -> dict:
        if self._final is not None:
            return self._final
        if self._sampler is None:
            raise RuntimeError("jaxvmm: this memory timeline was never started")
        return dict(self._sampler.summary())

    # ---- results (live while running, final after stop) ----
    @property
    def samples_taken(self) -> int:
        return int(self._summary()["taken"])

    @property
    def errors(self) -> int:
        """Driver reads that failed (not recorded)."""
        return int(self._summary()["errors"])

    @property
    def total_bytes(self) -> int:
        """The device's memory (0 on the POSIX backend)."""
        return int(self._summary()["total"])

    @property
    def first_used_bytes(self) -> int:
        """Used bytes at the first sample (taken by start()): the baseline."""
        return int(self._summary()["first"][1])

    @property
    def peak(self) -> Sample:
        return self._sample(self._summary()["peak"])

    @property
    def peak_used_bytes(self) -> int:
        """The most used bytes of any sample."""
        return int(self._summary()["peak"][1])

    @property
    def mapped_at_peak_bytes(self) -> int:
        """jaxvmm's mapped bytes (every slot on the device) at the sample of ``peak_used_bytes``."""
        return int(self._summary()["peak"][2])

    @property
    def internal_at_peak_bytes(self) -> int:
        """jaxvmm's own mapped bytes (staging and graph-mode cells) at the sample of ``peak_used_bytes``."""
        return int(self._summary()["peak"][3])

    @property
    def peak_mapped_bytes(self) -> int:
        """The most jaxvmm mapped bytes of any sample (not necessarily at the used peak)."""
        return int(self._summary()["peak_mapped"])

    @property
    def elapsed_s(self) -> float:
        return self._summary()["elapsed_ns"] / 1e9

    def series(self):
        """The kept samples, oldest first: a numpy ``int64`` array of shape ``(n, 4)`` with columns
        ``t_ns, used_bytes, mapped_bytes, internal_bytes`` (``t_ns``: nanoseconds since :meth:`start`)."""
        import numpy as np

        raw = self._series if self._final is not None else bytes(self._sampler.series())
        return np.frombuffer(raw, dtype=np.int64).reshape(-1, 4)

    def samples(self) -> list[Sample]:
        return [self._sample(r) for r in self.series().tolist()]

    @staticmethod
    def _sample(r) -> Sample:
        return Sample(r[0] / 1e9, int(r[1]), int(r[2]), int(r[3]))

    def describe(self) -> str:
        s = self._summary()
        gib = 1 << 30
        return (f"device memory timeline ({self.source}, every {self.interval_us:g} us, {s['taken']} samples): "
                f"peak {s['peak'][1] / gib:.2f} GiB used at t={s['peak'][0] / 1e9:.3f} s "
                f"(start {s['first'][1] / gib:.2f} GiB); jaxvmm mapped then {s['peak'][2] / gib:.2f} GiB, "
                f"of which staging/graph cells {s['peak'][3] / gib:.2f} GiB")


@contextlib.contextmanager
def memory_timeline(device=None, *, interval_us: float = DEFAULT_INTERVAL_US, capacity: int = DEFAULT_CAPACITY):
    """Samples ``device``'s memory for the block; yields the :class:`MemoryTimeline` (read it after)."""
    tl = MemoryTimeline(device, interval_us=interval_us, capacity=capacity)
    tl.start()
    try:
        yield tl
    finally:
        tl.stop()


# ---------------------------------------------------------------- pinned host usage


def host_stats() -> dict:
    """Host memory of jaxvmm's offload engines, summed over devices and over both host stores (the
    pinned pool and, with ``host_store="host_numa"``, the HOST_NUMA store): ``pinned_bytes`` /
    ``host_numa_bytes`` (held from the driver), ``in_use_bytes`` (holding offloaded arrays now),
    ``peak_in_use_bytes`` (since the engines started), ``window_peak_in_use_bytes`` (since the last
    :func:`reset_peaks`: per step, when a training loop calls reset_peaks() before each step),
    ``limit_bytes`` (the pool limit per device and store) and ``staging_window_peak_bytes`` (device
    staging pages mapped, peak since reset_peaks())."""
    from .ops import engine_stats

    out = {"pinned_bytes": 0, "host_numa_bytes": 0, "in_use_bytes": 0, "peak_in_use_bytes": 0,
           "window_peak_in_use_bytes": 0, "limit_bytes": 0, "staging_window_peak_bytes": 0}
    for st in engine_stats().values():
        out["pinned_bytes"] += int(st["pinned_bytes"])
        out["host_numa_bytes"] += int(st.get("host_numa_bytes", 0))
        for store in ("pinned", "host_numa"):
            out["in_use_bytes"] += int(st.get(f"{store}_in_use_bytes", 0))
            out["peak_in_use_bytes"] += int(st.get(f"{store}_peak_in_use_bytes", 0))
            out["window_peak_in_use_bytes"] += int(st.get(f"{store}_window_peak_bytes", 0))
        out["staging_window_peak_bytes"] += int(st["staging_window_peak_bytes"])
        out["limit_bytes"] = max(out["limit_bytes"], int(st["pinned_limit_bytes"]))
    return out


def reset_peaks() -> None:
    """Restart every window peak from the values now: pinned host in use and staging mapped
    (``window_peak_in_use_bytes``, ``staging_window_peak_bytes`` and their ``engine_stats()``
    counterparts) and the slots' ``peak_mapped_bytes`` (as :func:`jaxvmm.reset_peak_stats`). Peaks since
    start (``pinned_peak_in_use_bytes``, ``staging_peak_bytes``) are kept."""
    for backend, device in lib.engine_devices():
        lib.engine(backend, device).reset_peaks()
    lib.reset_peak()


# ---------------------------------------------------------------- ballast


class Ballast:
    """Device memory held so that only ``leave_free`` bytes stay free on CUDA device ``ordinal``: a fixed
    budget that XLA and jaxvmm share. Made without initializing jax (create it before jax allocates
    anything); ``nbytes`` is what it holds (0 when less than ``leave_free`` was free). The pages are a
    jaxvmm slot's, so they count in ``jaxvmm.stats()`` as a user slot. :meth:`close` returns them."""

    CHUNK = 8 << 30  # the largest piece one slot holds

    def __init__(self, leave_free: int, *, ordinal: int = 0):
        if isinstance(leave_free, bool) or not isinstance(leave_free, int) or leave_free < 0:
            raise ValueError(f"jaxvmm: Ballast: leave_free must be an int >= 0, got {leave_free!r}")
        free, total = (int(v) for v in lib.memory_info("cuda", ordinal))
        gran = int(lib.granularity("cuda", ordinal, "device", ordinal))
        n = max(0, (free - leave_free) // gran * gran)
        self.ordinal, self.total_bytes, self.free_before_bytes = ordinal, total, free
        self._slots = []
        try:
            while n > 0:  # in pieces of at most CHUNK: one huge physical allocation is needlessly fragile
                piece = min(n, self.CHUNK)
                self._slots.append(lib.create_slot("cuda", ordinal, "device", ordinal, [ordinal], piece, ""))
                n -= piece
        except BaseException:
            self.close()
            raise
        self.nbytes = sum(int(s.info()["mapped_bytes"]) for s in self._slots)
        self.free_after_bytes = int(lib.memory_info("cuda", ordinal)[0])

    def close(self) -> None:
        while self._slots:
            self._slots.pop().close()
        self.nbytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
