"""Call sites: the number each offload/reload/prefetch call carries to the engine, remembered with the
Python line that made it, so that an error the engine writes as ``[call site N]`` names that line."""

from __future__ import annotations

import collections
import itertools
import os
import re
import sys
import threading

import jax

_lock = threading.Lock()  # guards the tables below only

_sites = itertools.count(1)
_SITE_LINES: "collections.OrderedDict[int, str]" = collections.OrderedDict()  # site -> "op at file:line (fn)"
_eager_sites: "collections.OrderedDict[tuple, int]" = collections.OrderedDict()  # (op, line, key) -> site
_MAX_SITES = 1 << 14
_OWN = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep, os.sep + "jaxvmm" + os.sep, os.sep + "flax" + os.sep)


def new_site(op: str, eager_key=None) -> int:
    """A call-site number, remembered with the first user frame that made it (errors name it).

    A traced call gets a new number (one per trace: the number is an attribute, which also keeps XLA
    from merging two offloads of one value). An eager call (``eager_key``: the call's shape, dtype and
    placement) runs as a one-op program with the number among its attributes: it reuses the number of
    the calls from the same source line with the same key, so that program compiles once rather than
    at every call."""
    f = sys._getframe(1)
    while f is not None and (any(o in f.f_code.co_filename for o in _OWN) or f.f_code.co_filename.startswith("<")):
        f = f.f_back
    where = f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})" if f is not None else "unknown"
    with _lock:
        key = (op, where, eager_key)
        n = _eager_sites.get(key) if eager_key is not None else None
        if n is None:
            n = next(_sites)
            if eager_key is not None:
                _eager_sites[key] = n
                if len(_eager_sites) > _MAX_SITES:
                    _eager_sites.popitem(last=False)
        else:
            _eager_sites.move_to_end(key)
        _SITE_LINES[n] = f"{op} at {where}"
        _SITE_LINES.move_to_end(n)
        if len(_SITE_LINES) > _MAX_SITES:
            _SITE_LINES.popitem(last=False)
    return n


def eager_key(*arrays):
    """What an eager call's one-op program is compiled for, besides its attributes (see new_site);
    None when any of ``arrays`` is traced (inside jit, vmap, grad: a new site each call)."""
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        return None
    return tuple((tuple(a.shape), str(a.dtype), str(getattr(a, "sharding", None))) for a in arrays)


def name_sites(msg: str) -> str:
    """``msg`` with every ``[call site N]`` the engine wrote spelled out as the Python line that made it."""
    def sub(m):
        line = _SITE_LINES.get(int(m.group(1)))
        return f"[call site {m.group(1)}: {line}]" if line else m.group(0)
    return re.sub(r"\[call site (\d+)\]", sub, msg)
