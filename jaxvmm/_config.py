"""Every ``JAXVMM_*`` environment variable, parsed once at import.

The native core used to read some of these itself, with ``strtoull``/``atoi`` (``1M`` was one byte,
``abc`` was silently ignored). Now this module is the single parser: a bad value raises
``jaxvmm.InvalidArgumentError`` naming the variable and the value at ``import jaxvmm``, and the values
are pushed into the core through ``lib.configure`` (sizes, depths) or ``lib.set_trace``. Variables the
core still reads lazily by itself (``JAXVMM_PREDICT``, ``JAXVMM_WORKER_SPIN_US``, ``JAXVMM_RING_PROFILE``,
read by the engine) are validated here and
rewritten in the environment in the one spelling the core understands.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import warnings

from . import errors

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
# More jaxvmm ops than the engine's ring of op records can never be in flight, so a deeper prefetch means nothing.
MAX_PREFETCH_DEPTH = 1024
# Graph-mode cells per channel (ffi/graph_words.h, kMaxCells).
MAX_GRAPH_CELLS = 4
# Spare cells per graph-mode offload channel (ffi/graph_words.h, kMaxSpares).
MAX_GRAPH_SPARES = 64

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bad(where: str, value, why: str) -> errors.InvalidArgumentError:
    return errors.InvalidArgumentError(f"jaxvmm: {where}={value!r} is invalid: {why}", code="invalid_argument")


def parse_size(value, where: str, *, lo: int = 1, hi: int = INT64_MAX) -> int:
    """Bytes from an int or a string: plain bytes or a binary suffix (K, M, G, T, KB, MB, GB, TB, KiB,
    MiB, GiB, TiB; case-insensitive; all powers of 1024). ``where`` names the variable or argument."""
    if isinstance(value, bool):
        raise _bad(where, value, "expected a size in bytes (an int, or a string such as '512M' or '1GiB')")
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise _bad(where, value, "expected a size: bytes, or a number with one of the suffixes "
                                     "K, M, G, T, KB, MB, GB, TB, KiB, MiB, GiB, TiB (powers of 1024)")
        n = int(m.group(1)) * _UNITS[unit]
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise _bad(where, value, "expected a size in bytes (an int, or a string such as '512M')") from None
    if not lo <= n <= hi:
        raise _bad(where, value, f"must be between {lo} and {hi} bytes")
    return n


def parse_int(value, where: str, *, lo: int, hi: int) -> int:
    if isinstance(value, bool):
        raise _bad(where, value, f"expected an integer in [{lo}, {hi}]")
    if isinstance(value, str):
        if not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise _bad(where, value, f"expected an integer in [{lo}, {hi}]")
        n = int(value)
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise _bad(where, value, f"expected an integer in [{lo}, {hi}]") from None
    if not lo <= n <= hi:
        raise _bad(where, value, f"expected an integer in [{lo}, {hi}]")
    return n


def parse_bool(value: str, where: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE or v == "":
        return False
    raise _bad(where, value, f"expected one of {', '.join(_TRUE + _FALSE)}")


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # "size" | "int" | "bool" | "choice"
    lo: int = 0
    hi: int = INT64_MAX
    doc: str = ""
    choices: tuple = ()


HOST_STORES = ("pinned", "host_numa")
GRAPH_HOLDS = ("spares", "large")


def parse_choice(value, where: str, choices) -> str:
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in choices:
        raise _bad(where, value, f"expected one of {', '.join(repr(c) for c in choices)}")
    return v


# The one list of environment variables jaxvmm reads (README's table is generated from the same facts).
VARIABLES = {
    v.name: v
    for v in (
        EnvVar("JAXVMM_HOST_POOL_LIMIT", "size", 1, INT64_MAX, "cap on pinned host bytes (default: half of RAM)"),
        EnvVar("JAXVMM_HOST_POOL_CHUNK", "size", 1, INT64_MAX, "bytes pinned per driver allocation (256 MiB)"),
        EnvVar("JAXVMM_COPY_CHUNK", "size", 0, INT64_MAX,
               "D2H/H2D copies go in pieces of at most this many bytes; 0: one copy (64 MiB)"),
        EnvVar("JAXVMM_HOST_STORE", "choice", doc="where offloaded bytes live on the host: pinned or host_numa (pinned)",
               choices=HOST_STORES),
        EnvVar("JAXVMM_PREFETCH_DEPTH", "int", 1, MAX_PREFETCH_DEPTH,
               "staging cells per array size and direction copies may use at once (2)"),
        EnvVar("JAXVMM_STAGING_BUDGET", "size", 1, INT64_MAX, "cap on mapped staging bytes per device (8 GiB)"),
        EnvVar("JAXVMM_STAGING_IDLE_MS", "int", 1, INT64_MAX, "idle time before staging pages go back (200)"),
        EnvVar("JAXVMM_KEEP_RESIDENT", "int", 0, INT32_MAX, "newest offloads that keep a device copy (0)"),
        EnvVar("JAXVMM_TRACE", "bool", doc="log every lifecycle driver call (off)"),
        EnvVar("JAXVMM_GRAPH", "bool", doc="let XLA capture the CUDA handlers into command buffers (on)"),
        EnvVar("JAXVMM_GRAPH_CELLS", "int", 1, MAX_GRAPH_CELLS,
               "graph mode: staging cells per call site, so consecutive rounds overlap their copies (2)"),
        EnvVar("JAXVMM_GRAPH_SPARES", "int", 0, MAX_GRAPH_SPARES,
               "graph mode: spare cells per offload call site, lent while PCIe is behind (0)"),
        EnvVar("JAXVMM_GRAPH_SPARE_BUDGET", "size", 0, INT64_MAX,
               "graph mode: device memory spare cells may hold at once per device; set, it gives "
               "every offload call site spares (up to JAXVMM_GRAPH_SPARES when that is set, else 64) (0: no cap)"),
        EnvVar("JAXVMM_GRAPH_HOLD", "choice",
               doc="graph mode: which offload cells are held after their round, their bytes readable "
                   "on the device, instead of armed behind their D2H: spares (only while every spare is lent) or large "
                   "(also the one cell of a call site whose arrays are 32 MiB or more, until its next round; the default)",
               choices=GRAPH_HOLDS),
        EnvVar("JAXVMM_PREDICT", "bool", doc="predict which ticket a reload holds (on)"),
        EnvVar("JAXVMM_WORKER_SPIN_US", "int", 0, 100_000,
               "how long the engine's workers spin (yielding) on an op's event or word before they nap (50)"),
        EnvVar("JAXVMM_RING_PROFILE", "bool",
               doc="time each part of the uncaptured offload/reload handlers (engine_stats: handler_*_sections_ns) (off)"),
        EnvVar("JAXVMM_POSIX_ASYNC", "int", 0, 10_000_000,
               "tests, cpu platform: each driver stream runs its operations on a thread of its own, as a GPU stream "
               "does; N > 1 also delays each by a random 0..N us (0: off)"),
        EnvVar("JAXVMM_POSIX_LINK_US", "int", 0, 10_000_000,
               "tests, cpu platform with JAXVMM_POSIX_ASYNC: each copy between pinned memory and the device (D2H, "
               "H2D) takes N us more on its stream, as a link slower than the device (0: off)"),
        EnvVar("JAXVMM_POSIX_DTOD_US", "int", 0, 10_000_000,
               "tests, cpu platform with JAXVMM_POSIX_ASYNC: each device-to-device copy on a side stream waits N us "
               "on its stream before it reads its source, as behind a busy device (0: off)"),
        EnvVar("JAXVMM_REQUIRE_GPU", "bool", doc="tests: a gpu test without a GPU fails instead of skipping (off)"),
        EnvVar("JAXVMM_REQUIRE_2GPU", "bool", doc="tests: a 2-GPU test with fewer GPUs fails instead of skipping (off)"),
    )
}


def read_environment(environ=None) -> dict:
    """Parses every ``JAXVMM_*`` variable set in ``environ`` (default ``os.environ``); returns
    ``{name: value}`` for those set. Raises ``InvalidArgumentError`` on the first bad value; warns about
    ``JAXVMM_*`` names jaxvmm does not know (a typo would otherwise be silently ignored)."""
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(k for k in env if k.startswith("JAXVMM_")):
        raw = env[name]
        var = VARIABLES.get(name)
        if var is None:
            warnings.warn(f"jaxvmm: unknown environment variable {name}={raw!r} is ignored "
                          f"(known: {', '.join(sorted(VARIABLES))})", stacklevel=2)
            continue
        if var.kind == "size":
            out[name] = parse_size(raw, name, lo=var.lo, hi=var.hi)
        elif var.kind == "int":
            out[name] = parse_int(raw, name, lo=var.lo, hi=var.hi)
        elif var.kind == "choice":
            out[name] = parse_choice(raw, name, var.choices)
        else:
            out[name] = parse_bool(raw, name)
    return out


def apply(lib, values: dict) -> None:
    """Pushes parsed values into the native core."""
    lib.configure(values.get("JAXVMM_HOST_POOL_LIMIT", -1), values.get("JAXVMM_HOST_POOL_CHUNK", 0),
                  values.get("JAXVMM_PREFETCH_DEPTH", 0), values.get("JAXVMM_KEEP_RESIDENT", -1),
                  values.get("JAXVMM_STAGING_BUDGET", 0), values.get("JAXVMM_STAGING_IDLE_MS", 0))
    lib.set_trace(bool(values.get("JAXVMM_TRACE", False)))
    if "JAXVMM_GRAPH_HOLD" in values:
        lib.graph_hold(values["JAXVMM_GRAPH_HOLD"])
    if "JAXVMM_GRAPH_CELLS" in values:
        lib.graph_cells(values["JAXVMM_GRAPH_CELLS"])
    if "JAXVMM_GRAPH_SPARES" in values:
        lib.graph_spares(values["JAXVMM_GRAPH_SPARES"])
    if "JAXVMM_GRAPH_SPARE_BUDGET" in values:
        lib.graph_spare_budget(values["JAXVMM_GRAPH_SPARE_BUDGET"])
    if "JAXVMM_COPY_CHUNK" in values:
        lib.copy_chunk(values["JAXVMM_COPY_CHUNK"])
    if "JAXVMM_HOST_STORE" in values:
        lib.set_host_store(values["JAXVMM_HOST_STORE"])
    # The engine reads these itself (a prediction, a worker's first wait, an engine's start), in the
    # canonical form written back here: "0" / "1", a plain integer.
    for name in ("JAXVMM_PREDICT", "JAXVMM_RING_PROFILE"):
        if name in values:
            os.environ[name] = "1" if values[name] else "0"
    if "JAXVMM_WORKER_SPIN_US" in values:
        os.environ["JAXVMM_WORKER_SPIN_US"] = str(values["JAXVMM_WORKER_SPIN_US"])


def load(lib) -> dict:
    values = read_environment()
    apply(lib, values)
    return values
