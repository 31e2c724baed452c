"""Every jaxvmm setting, declared once: its name, environment variable, type, default, range, doc and
audience. Everything else is derived from this table:

- the environment, parsed once at ``import jaxvmm`` (``load``): a bad value raises
  ``jaxvmm.InvalidArgumentError`` naming the variable and the value; an unknown ``JAXVMM_*`` name warns;
- the native core's values: every setting the core reads is pushed, defaults included, through the one
  native entry ``lib.set_setting(name, value)`` (ffi/config.h), and read back with ``lib.get_setting``.
  The core reads no ``JAXVMM_*`` variable itself, and nothing is written back into the environment;
- ``jaxvmm.configure(**kw)`` (the user settings the core reads, changeable at run time) and
  ``jaxvmm.testing.configure_debug(**kw)`` (the debug ones), validated here before anything reaches the
  core, each returning the values in force read back from the core;
- README's table of environment variables (``python -m jaxvmm._config --markdown``; tests/test_config.py
  checks that README holds exactly these rows).

Audiences: ``user`` settings (at most 12) are the ones a user has a reason to turn; ``debug`` ones
(``JAXVMM_DEBUG_*``) are diagnostics and the cpu platform's test models, kept out of README's table and
out of ``configure()``; ``test`` ones are switches of the test runner (tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import sys
import textwrap
import warnings

from . import errors

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1

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


def _bad_type(where: str, value, why: str) -> errors.InvalidArgumentTypeError:
    return errors.InvalidArgumentTypeError(f"jaxvmm: {where}={value!r} is invalid: {why}", code="invalid_argument")


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


def parse_choice(value, where: str, choices) -> str:
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in choices:
        raise _bad(where, value, f"expected one of {', '.join(repr(c) for c in choices)}")
    return v


def _half_of_physical_memory() -> int:
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        n = 0
    return n // 2 if n > 0 else 16 << 30


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str  # configure()'s keyword, the native core's name (ffi/config.cc)
    env: str  # the environment variable
    kind: str  # "size" | "int" | "bool" | "choice"
    default: object  # a value, or a function of nothing computed at import
    doc: str  # one line: README's table, configure()'s docstring
    audience: str  # "user" | "debug" | "test"
    lo: int = 0
    hi: int = INT64_MAX
    choices: tuple = ()
    core: bool = True  # read by the native core (pushed, changeable at run time); else read by Python once
    shown_default: str = ""  # README's default column where the default is computed

    def parse_env(self, raw: str):
        """The value of the environment string ``raw``."""
        if self.kind == "size":
            return parse_size(raw, self.env, lo=self.lo, hi=self.hi)
        if self.kind == "int":
            return parse_int(raw, self.env, lo=self.lo, hi=self.hi)
        if self.kind == "choice":
            return parse_choice(raw, self.env, self.choices)
        return parse_bool(raw, self.env)

    def parse_arg(self, value, where: str):
        """The value of a Python argument (``configure``): sizes also as strings; integers, switches and
        choices of their own type only."""
        where = f"{where}: {self.key}"
        if self.kind == "size":
            return parse_size(value, where, lo=self.lo, hi=self.hi)
        if self.kind == "int":
            if isinstance(value, str):  # environment strings are parsed at import; the Python API takes ints
                raise _bad_type(where, value, "expected an int")
            return parse_int(value, where, lo=self.lo, hi=self.hi)
        if self.kind == "choice":
            if not isinstance(value, str):
                raise _bad_type(where, value, f"expected one of {', '.join(repr(c) for c in self.choices)}")
            return parse_choice(value, where, self.choices)
        if not isinstance(value, bool):
            raise _bad_type(where, value, "expected True or False")
        return value

    def default_value(self):
        return self.default() if callable(self.default) else self.default


SETTINGS: dict[str, Setting] = {
    s.key: s
    for s in (
        # ---- user settings: the ones a user has a reason to turn (at most 12) ----
        Setting("host_pool_limit", "JAXVMM_HOST_POOL_LIMIT", "size", _half_of_physical_memory,
                "cap on the host bytes of offloaded arrays, per store: offloads past it raise OutOfMemoryError; "
                "lowering it returns empty chunks at once, the others as their tickets are freed",
                "user", lo=1, shown_default="half of RAM"),
        Setting("host_store", "JAXVMM_HOST_STORE", "choice", "pinned",
                "where offloads from now on keep their bytes on the host: page-locked chunks (`pinned`) or VMM pages "
                "on the device's host NUMA node (`host_numa`; *The host store*)",
                "user", choices=("pinned", "host_numa")),
        Setting("prefetch_depth", "JAXVMM_PREFETCH_DEPTH", "int", 2,
                "staging cells per array size and direction that copies may use at once: how far copies of one "
                "size run ahead of XLA's stream",
                # More jaxvmm ops than the engine's ring of op records can never be in flight.
                "user", lo=1, hi=1024),
        Setting("keep_resident", "JAXVMM_KEEP_RESIDENT", "int", 0,
                "how many of the newest offloads keep a device copy, so that their reloads (in training the first "
                "ones of the backward pass) never wait for PCIe; counted in the staging budget",
                "user", lo=0, hi=INT32_MAX),
        Setting("staging_budget", "JAXVMM_STAGING_BUDGET", "size", 8 << 30,
                "cap on mapped staging bytes per device (copies in flight, prefetches, kept copies, graph-mode "
                "cells); an array larger than it cannot be offloaded",
                "user", lo=1),
        Setting("staging_idle_ms", "JAXVMM_STAGING_IDLE_MS", "int", 200,
                "milliseconds without an op before staging pages go back to the driver (`jaxvmm.trim()`: at once)",
                "user", lo=1, hi=INT64_MAX),
        Setting("graph_cells", "JAXVMM_GRAPH_CELLS", "int", 2,
                "graph mode: staging cells per call site and direction, taken in turn by consecutive rounds so "
                "that their copies overlap the compute (`1`: one cell); for call sites prepared from then on",
                # ffi/graph_words.h, kMaxCells
                "user", lo=1, hi=4),
        Setting("graph_spare_budget", "JAXVMM_GRAPH_SPARE_BUDGET", "size", 0,
                "graph mode: device memory spare cells may hold at once over a device's offload call sites, lent "
                "while PCIe is behind the device; set, it gives every call site prepared from then on spares "
                "(`0`: none; *Spare cells*)",
                "user", lo=0),
        Setting("graph", "JAXVMM_GRAPH", "bool", True,
                "register the CUDA handlers as command-buffer compatible, so that XLA may capture them (off: XLA "
                "never does); read at `import jaxvmm`",
                "user", core=False),
        # ---- debug: diagnostics, protocol variants and the cpu platform's test models ----
        Setting("host_pool_chunk", "JAXVMM_DEBUG_HOST_POOL_CHUNK", "size", 256 << 20,
                "bytes pinned per driver allocation (a larger request gets a chunk of its own)", "debug", lo=1),
        Setting("copy_chunk", "JAXVMM_DEBUG_COPY_CHUNK", "size", 64 << 20,
                "D2H/H2D copies between staging cells and host blocks go in pieces of at most this many bytes, so "
                "that other copies interleave with a large one (`0`: one copy per op)", "debug", lo=0),
        Setting("graph_spares", "JAXVMM_DEBUG_GRAPH_SPARES", "int", 0,
                "graph mode: spare cells per offload call site prepared from then on (0: 64 when "
                "graph_spare_budget is set, else none)",
                # ffi/graph_words.h, kMaxSpares
                "debug", lo=0, hi=64),
        Setting("graph_hold", "JAXVMM_DEBUG_GRAPH_HOLD", "choice", "large",
                "graph mode: offload cells held after their round, their bytes readable on the device: also the "
                "one cell of a call site whose arrays are 32 MiB or more, until its next round (`large`), or only "
                "those of call sites whose spares are all lent (`spares`)",
                "debug", choices=("large", "spares")),
        Setting("trace", "JAXVMM_DEBUG_TRACE", "bool", False,
                "log every lifecycle driver call with its slot id, stage, result and duration to stderr", "debug"),
        Setting("predict", "JAXVMM_DEBUG_PREDICT", "bool", True,
                "predict which ticket a reload holds (off: every reload is corrected by the resolver)", "debug"),
        Setting("worker_spin_us", "JAXVMM_DEBUG_WORKER_SPIN_US", "int", 50,
                "how long the engine's workers spin (yielding) on an op's event or word before they nap (10 us, "
                "doubling up to 200 us); `0`: nap at once", "debug", lo=0, hi=100_000),
        Setting("ring_profile", "JAXVMM_DEBUG_RING_PROFILE", "bool", False,
                "time each part of the handlers XLA did not capture (engine_stats: handler_*_sections_ns); read "
                "when an engine starts", "debug"),
        Setting("posix_async", "JAXVMM_DEBUG_POSIX_ASYNC", "int", 0,
                "cpu platform: each driver stream created from then on runs its operations on a thread of its "
                "own, as a GPU stream does; N > 1 also delays each by a random 0..N us (0: off)",
                "debug", lo=0, hi=10_000_000),
        Setting("posix_link_us", "JAXVMM_DEBUG_POSIX_LINK_US", "int", 0,
                "cpu platform, async streams: each copy between pinned memory and the device (D2H, H2D) takes N us "
                "more on its stream, as a link slower than the device (0: off)", "debug", lo=0, hi=10_000_000),
        Setting("posix_dtod_us", "JAXVMM_DEBUG_POSIX_DTOD_US", "int", 0,
                "cpu platform, async streams: each device-to-device copy on a side stream waits N us on its stream "
                "before it reads its source, as behind a busy device (0: off)", "debug", lo=0, hi=10_000_000),
        # ---- test runner switches (tests/conftest.py, tests/test_share.py) ----
        Setting("require_gpu", "JAXVMM_REQUIRE_GPU", "bool", False,
                "tests: a gpu test without a usable GPU fails instead of skipping", "test", core=False),
        Setting("require_2gpu", "JAXVMM_REQUIRE_2GPU", "bool", False,
                "tests: a 2-GPU test with fewer GPUs fails instead of skipping", "test", core=False),
    )
}
BY_ENV: dict[str, Setting] = {s.env: s for s in SETTINGS.values()}

# What the environment said at import (load), by key: the settings Python reads itself (core=False).
_from_env: dict = {}


def read_environment(environ=None) -> dict:
    """Parses every ``JAXVMM_*`` variable set in ``environ`` (default ``os.environ``); returns
    ``{key: value}`` for those set. Raises ``InvalidArgumentError`` on the first bad value; warns about
    ``JAXVMM_*`` names jaxvmm does not know (a typo would otherwise be silently ignored)."""
    env = os.environ if environ is None else environ
    out = {}
    for name in sorted(k for k in env if k.startswith("JAXVMM_")):
        raw = env[name]
        setting = BY_ENV.get(name)
        if setting is None:
            warnings.warn(f"jaxvmm: unknown environment variable {name}={raw!r} is ignored "
                          f"(known: {', '.join(sorted(BY_ENV))})", stacklevel=2)
            continue
        out[setting.key] = setting.parse_env(raw)
    return out


def _to_core(setting: Setting, value):
    return int(value) if setting.kind == "bool" else value


def _from_core(setting: Setting, value):
    return bool(value) if setting.kind == "bool" else value


def load(lib) -> None:
    """At import: parses the environment and pushes every setting the core reads, defaults included."""
    values = read_environment()
    for s in SETTINGS.values():
        value = values.get(s.key, s.default_value())
        if s.core:
            lib.set_setting(s.key, _to_core(s, value))
        else:
            _from_env[s.key] = value


def read_at_import(key: str):
    """The value of a setting Python reads itself, once, at import (``JAXVMM_GRAPH``, the test switches)."""
    s = SETTINGS[key]
    assert not s.core, f"{key} is read by the core: lib.get_setting({key!r})"
    return _from_env.get(key, s.default_value())


def keywords(audience: str) -> tuple[str, ...]:
    """The settings of ``audience`` the core reads: the keywords of ``configure`` (user) and
    ``jaxvmm.testing.configure_debug`` (debug)."""
    return tuple(k for k, s in SETTINGS.items() if s.audience == audience and s.core)


def configure(lib, audience: str, where: str, kw: dict) -> dict:
    """Validates every keyword first (nothing is set when one is bad), sets them in the core, returns the
    values in force of every setting of ``audience`` the core reads."""
    names = keywords(audience)
    parsed = {}
    for key, value in kw.items():
        if key not in names:
            other = SETTINGS.get(key)
            hint = (f" ({key} is a {other.audience} setting)" if other is not None and other.core
                    else f" (expected one of {', '.join(names)})")
            raise errors.InvalidArgumentTypeError(f"jaxvmm: {where}() got an unexpected keyword argument "
                                                  f"{key!r}{hint}", code="invalid_argument")
        if value is not None:
            parsed[key] = SETTINGS[key].parse_arg(value, where)
    for key, value in parsed.items():
        lib.set_setting(key, _to_core(SETTINGS[key], value))
    return {key: _from_core(SETTINGS[key], lib.get_setting(key)) for key in names}


# ---- documentation ----
def _size_text(n: int) -> str:
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _int_text(n: int) -> str:
    return {INT64_MAX: "2⁶³−1", INT32_MAX: "2³¹−1"}.get(n, str(n))


def accepted_values(s: Setting) -> str:
    if s.kind == "size":
        return "a size, or `0`" if s.lo == 0 else "a size"
    if s.kind == "int":
        return f"an integer ≥ {s.lo}" if s.hi == INT64_MAX else f"an integer in [{s.lo}, {_int_text(s.hi)}]"
    if s.kind == "choice":
        return " or ".join(f"`{c}`" for c in s.choices)
    return "a switch"


def shown_default(s: Setting) -> str:
    if s.shown_default:
        return s.shown_default
    if s.kind == "bool":
        return "on" if s.default else "off"
    if s.kind == "size":
        return f"`{_size_text(s.default)}`"
    return f"`{s.default}`"


def markdown(audience: str = "user") -> str:
    """README's table of the environment variables of ``audience``."""
    rows = ["| variable | accepted values | default | `configure()` | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS.values():
        if s.audience == audience:
            at_run_time = f"`{s.key}`" if s.core else "—"
            rows.append(f"| `{s.env}` | {accepted_values(s)} | {shown_default(s)} | {at_run_time} | {s.doc} |")
    return "\n".join(rows) + "\n"


def keywords_doc(audience: str) -> str:
    """The keywords of ``configure`` (or ``configure_debug``), for its docstring."""
    lines = []
    for key in keywords(audience):
        s = SETTINGS[key]
        lines.append(textwrap.fill(f"{key}: {s.doc} ({accepted_values(s)}; default {shown_default(s)}; env "
                                   f"``{s.env}``).", width=104, initial_indent="    ", subsequent_indent="      "))
    return "\n".join(lines)


def _main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "--markdown":
        sys.stdout.write(markdown(argv[1] if len(argv) > 1 else "user"))
        return 0
    sys.stderr.write("usage: python -m jaxvmm._config --markdown [user|debug|test]\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
